"""The embedded default model (a tiny DSV4 target + DSpark drafter trained on Python code).

`default_model_dir()` is what `Generator.from_pretrained()` and the CLI use when no model path is
given; the files ship inside the package, so a fresh clone serves with no download.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "tiny-code"


def default_model_dir() -> Path:
    """Directory of the embedded model (config.json, *.safetensors, tokenizer.json)."""
    path = Path(__file__).parent / DEFAULT_MODEL
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the embedded model is missing ({path}/config.json); reinstall jdspark or pass "
                                "--model PATH")
    return path
