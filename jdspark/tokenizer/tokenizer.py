"""A DSV4 `tokenizer.json` through huggingface `tokenizers`, and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path, bos_token_id: int | None = 0, eos_token_id: int | None = 1):
        self.path = Path(path)
        self.hf = HFTokenizer.from_file(str(self.path))
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with BOS first (DSV4 prompts start with it) unless asked otherwise."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Text deltas for a growing token list: each call returns exactly the text not yet returned.

    Decoding the whole list each time is what makes multi-token blocks safe (a block's tokens may
    merge into characters differently than one at a time); the tail is held back while it ends in
    an incomplete UTF-8 sequence (U+FFFD) or could still become a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.sent = 0  # characters already returned
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """Append tokens; returns the new text that is safe to emit (may be empty)."""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                text = text[:at]
        end = len(text)
        if not self.stopped:
            end = len(text.rstrip("\ufffd"))
            end -= max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
        delta = text[self.sent:max(end, self.sent)]
        self.sent += len(delta)
        return delta

    def finish(self) -> str:
        """The held-back tail once no more tokens come (a partial stop string is then real text)."""
        text = self.tokenizer.decode(self.tokens)
        if self.stopped:
            return ""
        delta = text[self.sent:]
        self.sent = len(text)
        return delta

    @property
    def text(self) -> str:
        full = self.tokenizer.decode(self.tokens)
        if self.stopped:
            at = min((full.find(s) for s in self.stop if s in full), default=len(full))
            return full[:at]
        return full
