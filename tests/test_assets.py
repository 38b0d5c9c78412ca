"""The embedded model: it ships in the package, loads with no download and no GPU, writes code, and
greedy speculative decoding reproduces greedy target-only decoding on it exactly (float32)."""

import pytest

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import load_model
from jdspark.engine.engine import SpecOptions
from jdspark.engine.request import SamplingParams
from jdspark.generator import Generator
from jdspark.tokenizer.tokenizer import Tokenizer

PROMPTS = ["def fib(n):", "import os\n\n\ndef list_files(path):"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def shipped():
    path = default_model_dir()
    return load_model(path, dtype="float32", progress=False), Tokenizer(path / "tokenizer.json")


def test_the_embedded_model_is_a_dsv4_with_a_drafter_and_a_tokenizer(shipped):
    model, tokenizer = shipped
    config = model.config
    assert config.dspark is not None and config.dspark.block_size == 5
    assert config.expert_dtype == "fp4" and config.quantization is not None
    assert {config.layer_kind(i) for i in range(config.num_hidden_layers)} == {"window", "csa", "hca"}
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert tokenizer.encode("x")[0] == config.bos_token_id == 0
    size = sum(f.stat().st_size for f in default_model_dir().iterdir())
    assert size <= 64e6, f"the embedded model takes {size / 1e6:.1f} MB; the package allows 64 MB"


@pytest.mark.slow  # two engines of the shipped model compiled
def test_greedy_speculative_equals_greedy_target_only_on_the_shipped_model(shipped):
    model, tokenizer = shipped
    gen = Generator.from_model(model, tokenizer, max_seq_len=96, prefill_chunk=32, options=SpecOptions(width=5))
    assert sorted(gen.engine.exe.step) == [5]  # a fixed width compiles that width alone (and the plain decode)
    for prompt in PROMPTS:
        gen.engine.set_policy(speculative=False)
        expected = gen.generate(prompt, GREEDY)
        gen.engine.set_policy(speculative=True)
        got = gen.generate(prompt, GREEDY)
        assert got.token_ids == expected.token_ids
        assert expected.stats.widths[0] == expected.stats.steps and got.stats.widths[5] == got.stats.steps
        assert got.stats.tau > 1.2  # drafts are accepted (an untrained drafter of 8192 tokens: tau ~ 1.0)
        if prompt == PROMPTS[0]:
            assert "return" in expected.text  # a plausible body for `def fib(n):`
