"""Token batches from a flat corpus array (documents as BOS + text + EOS, concatenated), and the
fixed held-out sets: consecutive windows (loss) and prompts cut from random files (generation)."""

from __future__ import annotations

from typing import Callable

import numpy as np


class Batches:
    """Random windows of `seq_len` tokens (plus the next one for targets), deterministic per seed."""

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int = 0):
        if tokens.size <= seq_len + 1:
            raise ValueError(f"the corpus has {tokens.size} tokens; need more than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.batch, self.seq_len = tokens.astype(np.int32), batch, seq_len
        self.rng = np.random.default_rng(seed)

    def next(self) -> np.ndarray:
        """[batch, seq_len + 1] int32."""
        starts = self.rng.integers(0, self.tokens.size - self.seq_len - 1, self.batch)
        return np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])


def heldout_windows(tokens: np.ndarray, seq_len: int, limit: int) -> np.ndarray:
    """Consecutive non-overlapping windows [n, seq_len + 1] (at most `limit`): a fixed eval set."""
    n = min(limit, (tokens.size - 1) // seq_len)
    return np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)


def heldout_prompts(texts: list[str], encode: Callable[[str], list[int]], count: int, length: int,
                    seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each from a different file taken in a seeded random order,
    ending at a random cut at least 64 tokens before the file's end. Generation is measured on
    these: consecutive windows are dominated by a few long files (the stdlib's held-out split holds
    codec tables on which the tiny target's loss is 0.03-0.8 nats/token), random files are not."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in rng.permutation(len(texts)):
        if len(prompts) == count:
            break
        ids = encode(texts[i])
        if len(ids) > length + 64:
            cut = int(rng.integers(length, len(ids) - 64))
            prompts.append(ids[cut - length:cut])
    return prompts
