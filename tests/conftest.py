"""Shared test set-up: float32 matmuls at full precision, the `gpu` marker skipped without a GPU,
a compilation counter, and the tiny speculative model and its engines shared by the engine and API
tests (session fixtures: one engine per configuration per test process)."""

import importlib.util
import os
import shutil
import tempfile

# XLA:CPU compile time is most of the suite's time (the tests run small models briefly), and two
# codegen settings halve it: LLVM at -O0 and the classic loop emitters instead of the MLIR fusion
# emitters (measured: the engine's greedy-equality cases 76 s -> 38 s on 2 cores). They change how
# kernels are generated, not what they compute. XLA reads the flags when its backend starts, so they
# are set before jax is imported; subprocesses inherit them. A machine with a jax GPU plugin keeps
# the defaults: its tests run the kernels as they are served.
CPU_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if importlib.util.find_spec("jax_plugins") is None:
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join([*_flags, *(f for f in CPU_TEST_XLA_FLAGS if f not in _flags)])

import jax  # noqa: E402
import pytest  # noqa: E402

from jdspark.config import EngineConfig, tiny_dspark_config  # noqa: E402
from jdspark.engine.engine import Engine  # noqa: E402
from jdspark.model.model import Model  # noqa: E402
from jdspark.tokenizer.tokenizer import Tokenizer  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# One temporary folder per run, made by the process that starts it (the xdist workers inherit the
# variable) and removed by that process at the end (`pytest_unconfigure`).
_MADE_HERE = "JDSPARK_TEST_RUN_DIR" not in os.environ
if _MADE_HERE:
    os.environ["JDSPARK_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="jdspark-test-")
_RUN_DIR = os.environ["JDSPARK_TEST_RUN_DIR"]
os.environ["JDSPARK_CACHE"] = tempfile.mkdtemp(prefix="cache-", dir=_RUN_DIR)  # measured costs stay out of ~
# Identical executables (the same tiny engine built twice, also by two xdist workers) compile once per run.
jax.config.update("jax_compilation_cache_dir", os.path.join(_RUN_DIR, "xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _MADE_HERE:  # in the process that made the folder, after its workers ended
        shutil.rmtree(_RUN_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class CompileCounter:
    """Counts XLA backend compilations (jax.monitoring events), to prove a warm path never recompiles."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, duration, **kwargs):
        if name.endswith("backend_compile_duration"):
            self.count += 1


_COMPILES = CompileCounter()


@pytest.fixture
def compile_counter() -> CompileCounter:
    return _COMPILES


# ---- a tiny target + DSpark drafter over a 16-symbol vocabulary, shared by engine and API tests ----

DSPARK_CONFIG = tiny_dspark_config(
    vocab_size=16, num_hidden_layers=3, compress_ratios=(0, 4, 16, 0, 0), num_hash_layers=1,
    extra=dict(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[1, 2], dspark_markov_rank=16))
CHARS = "abcdefghijklmn"  # token id i + 2 (0: BOS, 1: EOS)


@pytest.fixture(scope="session")
def dspark_model():
    return Model.random(DSPARK_CONFIG, "float32", seed=3)


@pytest.fixture(scope="session")
def dspark_engine(dspark_model, char_tokenizer):
    """Two slots in one batch bucket, every width compiled once for the session, the character
    tokenizer; users set `speculative` and `width_policy` and finish or cancel their requests.
    (Each bucket is a full set of executables; tests/engine/test_buckets.py tests buckets.)"""
    return Engine(dspark_model, EngineConfig(max_seq_len=256, gamma=5, max_batch=2, batch_buckets=(2,)), prefill_chunk=16,
                  tokenizer=char_tokenizer)


@pytest.fixture(scope="session")
def target_engine(dspark_model):
    """DSPARK_CONFIG's target alone: two slots, no tokenizer, speculative=False, so only prefill and
    decode are compiled (a fraction of `dspark_engine`'s start-up). For tests of what does not need
    the drafter; users finish or cancel their requests."""
    return Engine(dspark_model, EngineConfig(max_seq_len=64, gamma=5, max_batch=2, batch_buckets=(2,)),
                  prefill_chunk=16, speculative=False)


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory):
    """A character-level tokenizer.json for DSPARK_CONFIG's vocabulary."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer(models.WordLevel({"<bos>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}},
                                      unk_token="a"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(["<bos>", "<eos>"])
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    hf.save(str(path))
    return Tokenizer(path)


@pytest.fixture(scope="session")
def dspark_checkpoint(tmp_path_factory, char_tokenizer):
    """A random DSPARK_CONFIG checkpoint in the official layout, with the character tokenizer."""
    import shutil

    from jdspark.checkpoint.synthetic import write_checkpoint
    path = tmp_path_factory.mktemp("dspark_checkpoint")
    write_checkpoint(DSPARK_CONFIG, path, seed=1)
    shutil.copy(char_tokenizer.path, path / "tokenizer.json")
    return path


def generate_to_end(engine, prompt, params):
    """Run one request on `engine` until it finishes; returns its Completion."""
    return engine.complete([engine.add(prompt, params)])[0]
