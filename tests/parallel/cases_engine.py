"""The engine on a TP 2 x EP 2 mesh: greedy speculative == greedy target-only (and == the
unsharded engine), the decode state and draft cache stay replicated on the mesh after steps, and
nothing compiles after warm-up. Run with 4 CPU devices by test_sharded_engine.py (see devices.py)."""

import jax
import pytest

from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine
from jdspark.engine.request import SamplingParams
from jdspark.model.model import Model
from jdspark.parallel.shard import shard_model
from tests.conftest import generate_to_end
from tests.parallel.configs import PARALLEL_CONFIG

ENGINE = EngineConfig(max_seq_len=96, gamma=5, max_batch=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
PROMPTS = [list(range(5, 30)), [7, 300, 12], list(range(100, 140))]


@pytest.fixture(scope="module")
def model():
    return Model.random(PARALLEL_CONFIG, "float32", seed=3)


@pytest.fixture(scope="module")
def sharded(model):
    return shard_model(model, tensor_parallel_size=2, expert_parallel_size=2)


@pytest.fixture(scope="module")
def target_only(sharded):
    return Engine(sharded, ENGINE, prefill_chunk=16, speculative=False)


@pytest.fixture(scope="module")
def speculative(sharded):
    """Two widths, chosen from the stale confidences, so the verified width varies between steps."""
    return Engine(sharded, ENGINE, prefill_chunk=16, widths=(2, 5),
                  width_policy=lambda confidence: 5 if confidence[0] > 0.5 else 2)


def test_greedy_speculative_equals_greedy_target_only_under_sharding(speculative, target_only):
    for prompt in PROMPTS:
        spec = generate_to_end(speculative, prompt, GREEDY).token_ids
        assert spec == generate_to_end(target_only, prompt, GREEDY).token_ids
        assert len(spec) == GREEDY.max_tokens


def test_sharded_engine_equals_the_unsharded_one(model, target_only):
    unsharded = Engine(model, ENGINE, prefill_chunk=16, speculative=False)
    for prompt in PROMPTS[:2]:
        assert generate_to_end(unsharded, prompt, GREEDY).token_ids == \
            generate_to_end(target_only, prompt, GREEDY).token_ids


def test_state_and_draft_cache_stay_on_the_mesh(speculative, sharded):
    generate_to_end(speculative, PROMPTS[1], GREEDY)
    devices = set(sharded.mesh.devices.flat)
    for leaf in jax.tree.leaves((speculative.state, speculative.draft_cache)):
        assert leaf.sharding.is_fully_replicated and leaf.sharding.device_set == devices


def test_nothing_compiles_after_warm_up(speculative, target_only, compile_counter):
    for engine in (speculative, target_only):
        generate_to_end(engine, PROMPTS[0], GREEDY)  # warm-up: eager slot bookkeeping compiles once
    before = compile_counter.count
    for engine in (speculative, target_only):
        for prompt in PROMPTS:
            generate_to_end(engine, prompt, SamplingParams(temperature=0.8, max_tokens=12, seed=1))
    assert compile_counter.count == before


def test_packed_parameters_on_the_mesh_decode_the_same(sharded, target_only):
    """The GPU default: small replicated parameters packed per (dtype, sharding); sharded ones stay apart."""
    packed = Engine(sharded, ENGINE, prefill_chunk=16, speculative=False, pack_params=True)
    assert len(packed.exe.params.arrays) < len(jax.tree.leaves(sharded.params))
    assert generate_to_end(packed, PROMPTS[0], GREEDY).token_ids == generate_to_end(target_only, PROMPTS[0],
                                                                                   GREEDY).token_ids
