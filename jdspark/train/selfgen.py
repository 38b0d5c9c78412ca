"""Drafter training data sampled from the target itself (spec dspark.md §12.1, §13.1).

The drafter should learn the target's distribution on the contexts it will meet when serving,
which are the target's own samples; corpus text is a different distribution. Prompts are corpus
windows; each is continued through the serving engine (exact sampling of the target at the given
temperature, EOS ignored so every row has the same length), `max_batch` prompts at a time.
"""

from __future__ import annotations

import numpy as np

from jdspark.engine.engine import Engine
from jdspark.engine.request import SamplingParams


def sample_continuations(engine: Engine, prompts: np.ndarray, new_tokens: int, temperature: float = 1.0,
                         seed: int = 0) -> np.ndarray:
    """prompts [N, P] int -> [N, P + new_tokens]: each prompt followed by the target's tokens.
    Request i is seeded with seed + i, so the result does not depend on how rows are batched."""
    rows = []
    for start in range(0, len(prompts), engine.config.max_batch):
        chunk = prompts[start:start + engine.config.max_batch]
        first = engine.add_many([
            (prompt, SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=seed + start + i,
                                    ignore_eos=True))
            for i, prompt in enumerate(chunk)])
        for prompt, completion in zip(chunk, engine.complete(first)):
            rows.append(np.concatenate([prompt, completion.token_ids]).astype(np.int32))
    return np.stack(rows)


class GeneratedBatches:
    """Random rows of a generated set [N, S + 1] (prompt, then samples), deterministic per seed."""

    def __init__(self, rows: np.ndarray, batch: int, seed: int = 0):
        self.rows, self.batch = rows, batch
        self.rng = np.random.default_rng(seed)

    def next(self) -> np.ndarray:
        return self.rows[self.rng.integers(0, len(self.rows), self.batch)]
