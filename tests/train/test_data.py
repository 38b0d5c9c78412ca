import numpy as np

from jdspark.train.data import heldout_prompts


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_heldout_prompts_are_slices_of_distinct_long_enough_files():
    rng = np.random.default_rng(0)
    texts = ["".join(chr(97 + int(v)) for v in rng.integers(0, 26, n)) for n in (50, 300, 400, 120, 500, 90)]
    prompts = heldout_prompts(texts, encode, count=3, length=32, seed=5)
    assert len(prompts) == 3 and all(len(p) == 32 for p in prompts)
    sources = []
    for p in prompts:
        text = "".join(map(chr, p))
        hits = [i for i, t in enumerate(texts) if text in t]
        assert len(hits) == 1
        i = hits[0]
        assert len(texts[i]) > 32 + 64 and texts[i].index(text) + 32 <= len(texts[i]) - 64
        sources.append(i)
    assert len(set(sources)) == 3
    assert heldout_prompts(texts, encode, count=3, length=32, seed=5) == prompts
    assert heldout_prompts(texts, encode, count=3, length=32, seed=6) != prompts


def test_heldout_prompts_stop_at_the_files_that_are_long_enough():
    texts = ["x" * 200, "y" * 10, "z" * 97]
    prompts = heldout_prompts(texts, encode, count=5, length=32, seed=0)
    assert sorted("".join(map(chr, p)) for p in prompts) == ["x" * 32, "z" * 32]


def test_no_heldout_prompts_asked_none_given():
    assert heldout_prompts(["x" * 200], encode, count=0, length=32, seed=0) == []
