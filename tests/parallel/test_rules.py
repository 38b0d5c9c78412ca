"""The partition rules and the clear errors of bad sizes, in the test process (one CPU device:
nothing here needs a mesh of real devices)."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jdspark.cli import main
from jdspark.config import tiny_config
from jdspark.config.base import QuantConfig
from jdspark.model.quantized import Storage, abstract_model
from jdspark.parallel import distributed, rules
from jdspark.parallel.mesh import make_mesh


class SizesOnly:
    """A stand-in mesh for the checks, which read only the axis sizes."""

    def __init__(self, tensor=1, expert=1):
        self.shape = {"tensor": tensor, "expert": expert}


@pytest.mark.parametrize("path,spec", [
    (("embed", "weight"), P("tensor", None)),
    (("head", "weight"), P("tensor", None)),
    (("mtp", 1, "markov_head", "head", "weight"), P("tensor", None)),
    (("layers", 2, "attn", "wq_b", "weight"), P("tensor", None)),
    (("layers", 2, "attn", "wq_b", "scale"), P("tensor", None)),
    (("layers", 2, "attn", "attn_sink"), P("tensor")),
    (("layers", 2, "attn", "wo_a", "weight"), P("tensor", None)),
    (("layers", 2, "attn", "wo_b", "scale"), P(None, "tensor")),
    (("layers", 2, "ffn", "experts", "w1", "scale"), P("expert", "tensor", None)),
    (("layers", 2, "ffn", "experts", "w2", "weight"), P("expert", None, "tensor")),
    (("layers", 2, "ffn", "shared_experts", "w2", "weight"), P(None, "tensor")),
    (("layers", 2, "attn", "wkv", "weight"), P()),  # the one shared K=V head
    (("layers", 2, "attn", "indexer", "wq_b", "weight"), P()),  # exact top-k
    (("layers", 2, "attn", "compressor", "wkv", "weight"), P()),
    (("layers", 2, "ffn", "gate", "weight"), P()),  # exact routing
    (("layers", 2, "hc_attn", "fn"), P()),
])
def test_rule_of_each_parameter_kind(path, spec):
    assert rules.spec_of(path) == spec


def test_sizes_that_do_not_divide_name_the_field_and_the_fix():
    config = tiny_config()  # 4 heads in 2 groups, 8 experts
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide o_groups=2"):
        rules.check_config(config, SizesOnly(tensor=4))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        rules.check_config(config, SizesOnly(tensor=3))
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide n_routed_experts=8"):
        rules.check_config(config, SizesOnly(expert=3))
    rules.check_config(config, SizesOnly(tensor=2, expert=8))


def test_a_split_inside_a_quantization_block_is_refused():
    """tiny_config's wo_a output and wo_b input are 2 groups x 64 = 128 wide: one FP8 block, which TP 2
    would cut (wo_a, stored FP8, comes first)."""
    config = tiny_config(expert_dtype="fp4", quantization=QuantConfig())
    _, params = abstract_model(config, jnp.float32, Storage.from_config(config))
    with pytest.raises(ValueError, match=r"layers\.\d\.attn\.wo_a\.scale .*1 quantization block.*tensor=2"):
        rules.check(params, SizesOnly(tensor=2))
    rules.check(params, SizesOnly(expert=8))
    _, float_params = abstract_model(config, jnp.float32, Storage())
    rules.check(float_params, SizesOnly(tensor=2, expert=2))  # float weights split anywhere


def test_mesh_sizes_are_checked_against_the_devices():
    assert make_mesh(1, 1) is None
    with pytest.raises(ValueError, match="only 1 are present.*device_count=2"):
        make_mesh(2, 1)
    with pytest.raises(ValueError, match="expert_parallel_size=0"):
        make_mesh(1, 0)


def test_cli_reports_a_mesh_larger_than_the_devices(capsys):
    assert main(["generate", "x", "--tp", "2", "--ep", "2"]) == 2
    assert "= 4 devices, but only 1 are present" in capsys.readouterr().err


def test_distributed_flags_are_checked_before_jax_starts(monkeypatch):
    for name in distributed.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    with pytest.raises(ValueError, match="need a coordinator"):
        distributed.initialize(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="process_id=2 with num_processes=2"):
        distributed.initialize("localhost:1234", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="num_processes is needed"):
        distributed.initialize("localhost:1234", process_id=0)
    assert distributed.from_process_0([1.5, 2.0]) == [1.5, 2.0]


def test_qat_simulation_needs_whole_activation_blocks_per_device():
    from jdspark.model.model import Model
    from jdspark.parallel.shard import on_mesh
    model = Model.random(tiny_config(num_hidden_layers=1, num_hash_layers=1, compress_ratios=(0, 0)), "float32", qat_sim=True)
    with pytest.raises(ValueError, match="leaves 64 of moe_intermediate_size=128 per device"):
        on_mesh(model, SizesOnly(tensor=2))
