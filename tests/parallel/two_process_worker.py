"""One of the two processes of test_two_processes.py: `python two_process_worker.py PORT ID`.

Starts jax.distributed against the coordinator on localhost:PORT (process 0 hosts it), each
process with 2 CPU devices, shards the model over all 4 (TP 2 x EP 2, a tensor pair per process,
the experts across processes), runs the forward and prints one JSON line: the largest difference
to this process's own unsharded forward, and process 0's value as every process received it."""

import json
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # test_two_processes sets it
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jdspark.model.model import Model  # noqa: E402
from jdspark.parallel import distributed  # noqa: E402
from jdspark.parallel.shard import shard_model  # noqa: E402
from tests.parallel.configs import PARALLEL_CONFIG  # noqa: E402


def main(port: str, rank: int) -> None:
    distributed.initialize(f"localhost:{port}", num_processes=2, process_id=rank)
    jax.config.update("jax_default_matmul_precision", "highest")
    model = Model.random(PARALLEL_CONFIG, "float32", seed=3)
    ids = np.random.default_rng(0).integers(0, PARALLEL_CONFIG.vocab_size, (2, 16))
    reference = np.asarray(model.forward(ids).logits)
    sharded = shard_model(model, tensor_parallel_size=2, expert_parallel_size=2)
    logits = sharded.forward(ids).logits
    whole = jax.jit(lambda x: x, out_shardings=NamedSharding(sharded.mesh, PartitionSpec()))(logits)
    print(json.dumps({"process": rank, "processes": jax.process_count(), "devices": len(jax.devices()),
                      "max_abs_diff": float(np.abs(np.asarray(whole.addressable_data(0)) - reference).max()),
                      "from_process_0": distributed.from_process_0([float(rank) + 0.5])}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
