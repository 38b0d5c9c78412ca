"""The Python API: text and token-id prompts, streaming that adds up to the completion, clear errors."""

import json

import pytest

from jdspark import Generator, SamplingParams
from jdspark.engine.errors import EngineError
from tests.conftest import CHARS

# The session engine with every width (tests/conftest.py dspark_engine) is compiled for these: minutes on
# a 2-core CPU. `make test-fast` leaves them out; `make test` (CI) runs them.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def generator(dspark_engine):
    dspark_engine.set_policy(speculative=True)
    dspark_engine.set_policy(width_policy=lambda confidence: 5)
    return Generator(dspark_engine)


def test_generate_from_text_and_from_ids(generator, char_tokenizer):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    from_text = generator.generate("abcdmn", params)
    from_ids = generator.generate(char_tokenizer.encode("abcdmn"), params)
    assert from_text.token_ids == from_ids.token_ids and len(from_text.token_ids) == 30
    assert from_text.text == "".join(CHARS[t - 2] for t in from_text.token_ids if t >= 2)
    assert from_text.finish_reason == "length"
    stats = from_text.stats
    assert stats.tau >= 1 and len(stats.acceptance) == 5 and sum(stats.widths) == stats.steps
    assert stats.tokens_per_s > 0


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, top_k=6, top_p=0.9, seed=8, ignore_eos=True),
])
def test_stream_concatenates_to_generate(generator, params):
    deltas = list(generator.stream("hello", params))
    completion = generator.generate("hello", params)
    assert "".join(deltas) == completion.text and len(deltas) > 1


def test_stop_string_ends_the_text(generator):
    free = generator.generate("abc", SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True))
    stop = free.text[10:12]
    stopped = generator.generate("abc", SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                                                       stop=stop))
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:free.text.find(stop)]
    streamed = "".join(generator.stream("abc", SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                             ignore_eos=True, stop=stop)))
    assert streamed == stopped.text


def test_token_ids_without_tokenizer_and_clear_errors(target_engine):
    engine = target_engine
    bare = Generator(engine)
    out = bare.generate([0, 5, 6], SamplingParams(max_tokens=5, temperature=0.0))
    assert out.text is None and 1 <= len(out.token_ids) <= 5
    with pytest.raises(EngineError, match="a text prompt needs a tokenizer"):
        bare.generate("hello")
    with pytest.raises(EngineError, match="needs a tokenizer; use stop_token_ids"):
        bare.generate([0, 5], SamplingParams(max_tokens=8, stop="x"))
    assert engine.running == [] and engine.free_slots == 2  # failed requests leave no slot behind


def test_from_pretrained_loads_drafter_and_tokenizer(dspark_checkpoint):
    gen = Generator.from_pretrained(dspark_checkpoint, dtype="float32", max_seq_len=256, max_batch=2,
                                    batch_buckets=(2,), prefill_chunk=16)  # dspark_engine's shapes: cached
    assert gen.tokenizer is not None and sorted(gen.engine.exe.step) == [0, 1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    speculative = gen.generate("hello", params)
    gen.engine.set_policy(speculative=False)
    assert gen.generate("hello", params).token_ids == speculative.token_ids
    assert speculative.stats.verify_costs_s is not None and len(speculative.stats.verify_costs_s) == 6


def test_profile_writes_trace_decisions_and_plot(generator, tmp_path):
    from jdspark.profile import profile
    report = profile(generator, "abc", SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True),
                     tmp_path)
    assert (tmp_path / "profile.png").stat().st_size > 10_000
    assert any((tmp_path / "trace").rglob("*.xplane.pb"))
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert len(saved["steps"]) == report["stats"]["steps"] > 0
    step = saved["steps"][0]
    assert step["width"] in range(6) and len(step["rows"][0]["stale_confidence"]) == 5
