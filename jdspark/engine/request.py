"""What a user asks for (`SamplingParams`) and what they get back (`Completion`, `CompletionStats`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 are off. `stop` strings
    end the text (needs a tokenizer); `stop_token_ids` and the model's EOS end the token stream."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _number(self.temperature) and self.temperature >= 0, "a number >= 0 (0 is greedy)"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 is off)"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 32),
             "None or an integer in [0, 2**32)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be {expected}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


@dataclasses.dataclass
class CompletionStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0  # from the request's admission to its last token
    time_to_first_token_s: float = 0.0
    steps: int = 0  # verifications (each emits n_accepted + 1 tokens)
    emitted_by_steps: int = 0  # tokens those verifications emitted, bonus included, before stop truncation
    widths: list[int] = dataclasses.field(default_factory=list)  # widths[k]: steps that verified k drafts
    verified_at: list[int] = dataclasses.field(default_factory=list)  # position i was verified
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # position i was accepted
    draft_cost_s: float | None = None  # D the width selector used (None: fixed width)
    verify_costs_s: list[float] | None = None  # V(0..gamma) the width selector used

    @classmethod
    def empty(cls, prompt_tokens: int, gamma: int) -> "CompletionStats":
        return cls(prompt_tokens=prompt_tokens, widths=[0] * (gamma + 1), verified_at=[0] * gamma,
                   accepted_at=[0] * gamma)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification, bonus included (the paper's accepted length)."""
        return self.emitted_by_steps / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> list[float]:
        """Per draft position i: of the verifications whose width included position i, the fraction
        whose accepted prefix reached it (not conditional on positions before i being accepted)."""
        return [a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at)]

    def record_step(self, width: int, n_accepted: int) -> None:
        self.steps += 1
        self.emitted_by_steps += n_accepted + 1
        self.widths[width] += 1
        for i in range(width):
            self.verified_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                    elapsed_s=self.elapsed_s, time_to_first_token_s=self.time_to_first_token_s,
                    tokens_per_s=self.tokens_per_s, steps=self.steps, tau=self.tau, widths=list(self.widths),
                    acceptance=self.acceptance, draft_cost_s=self.draft_cost_s, verify_costs_s=self.verify_costs_s)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    text: str | None  # None without a tokenizer
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length" (max_tokens)
    stats: CompletionStats
