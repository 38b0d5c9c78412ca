"""The per-slot inputs and the step output of the executables: packed into one int32 array each
way, unpacked exactly (bit-cast floats and unsigned seeds included); a float32 model's executables
compute every dot product at full float32 precision whatever the ambient default."""

import re

import jax
import numpy as np

from jdspark.config import EngineConfig
from jdspark.engine import executables
from jdspark.engine.engine import Engine
from tests.conftest import SPEC_CONFIG


def test_slot_inputs_unpack_exactly_on_the_device():
    anchor = np.array([7, 0, 8191], np.int32)
    active = np.array([True, False, True])
    temperature = np.array([0.7, 0.0, 1.3], np.float32)
    top_k = np.array([50, 0, 3], np.int32)
    top_p = np.array([0.9, 1.0, np.nextafter(np.float32(1), np.float32(0))], np.float32)
    seed = np.array([2 ** 32 - 1, 0, 2 ** 31], np.uint32)
    counter = np.array([0, 5, 123456], np.int32)
    packed = executables.slot_inputs(anchor=anchor, active=active, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, counter=counter)
    assert packed.dtype == np.int32 and packed.shape == (3, len(executables.SLOT_FIELDS))
    got_anchor, got_active, sampling = jax.jit(executables._unpack_slots)(packed)
    np.testing.assert_array_equal(got_anchor, anchor)
    np.testing.assert_array_equal(got_active, active)
    for name, want in [("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                       ("counter", counter)]:
        got = np.asarray(getattr(sampling, name))
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_read_output_splits_a_step_and_a_decode_result():
    confidence = np.array([[0.9, 0.5, 0.25], [1.0, 0.0, 1e-30]], np.float32)
    step = np.concatenate([np.array([[2, 11], [0, 4]], np.int32), np.array([[5, 6, 7], [8, 9, 10]], np.int32),
                           confidence.view(np.int32)], axis=1)
    out = executables.read_output(step, gamma=3)
    np.testing.assert_array_equal(out.n_accepted, [2, 0])
    np.testing.assert_array_equal(out.token, [11, 4])
    np.testing.assert_array_equal(out.drafts, [[5, 6, 7], [8, 9, 10]])
    np.testing.assert_array_equal(out.confidence, confidence)
    decode = executables.read_output(np.array([[0, 3], [0, 9]], np.int32), gamma=3)
    assert decode.drafts is None and decode.confidence is None
    np.testing.assert_array_equal(decode.token, [3, 9])


def test_a_float32_model_compiles_every_dot_at_full_precision(spec_model):
    """Under a low ambient precision (TF32 is the GPU default) the engine's dots still say highest."""
    with jax.default_matmul_precision("bfloat16"):
        engine = Engine(spec_model, EngineConfig(max_seq_len=64, gamma=5, max_batch=1), prefill_chunk=8,
                        speculative=False)
    for exe in (engine.exe.prefill, engine.exe.decode):
        dots = re.findall(r" dot\(.*", exe.as_text())
        assert dots and all("operand_precision={highest,highest}" in d for d in dots)
