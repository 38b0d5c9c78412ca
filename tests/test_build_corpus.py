"""scripts/build_corpus.py: extra roots add training text only, never the held-out split or a copy of it."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_corpus.py"


@pytest.fixture(scope="module")
def build_corpus():
    spec = importlib.util.spec_from_file_location("build_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root: Path, rel: str, text: str):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def paths(split_file: Path) -> list[str]:
    return [json.loads(line)["path"] for line in split_file.read_text().splitlines()]


def test_extra_roots_train_only(build_corpus, tmp_path):
    stdlib, extra = tmp_path / "lib", tmp_path / "site-packages"
    names = [f"mod{i}.py" for i in range(40)]
    for name in names:
        write(stdlib, name, f"# {name}\nx = 1\n")
    held = [n for n in names if build_corpus.heldout(n, 50)]
    train = [n for n in names if n not in held]
    assert held and train
    write(extra, f"vendored/{held[0]}", "# a vendored copy of a held-out module\n")  # same name: left out
    write(extra, "pkg/dup.py", f"# {train[0]}\nx = 1\n")  # same text as a corpus file: left out
    write(extra, "pkg/new_a.py", "a = 'a' * 100\n")
    write(extra, "pkg/new_b.py", "b = 'b' * 100\n")
    base, more = tmp_path / "base", tmp_path / "more"
    build_corpus.main(["--out", str(base), "--root", str(stdlib), "--heldout-percent", "50"])
    build_corpus.main(["--out", str(more), "--root", str(stdlib), "--heldout-percent", "50",
                       "--extra-root", str(extra), "--extra-bytes", "20"])
    assert (more / "heldout.jsonl").read_bytes() == (base / "heldout.jsonl").read_bytes()
    added = sorted(set(paths(more / "train.jsonl")) - set(paths(base / "train.jsonl")))
    assert len(added) == 1 and added[0] in ("site-packages/pkg/new_a.py", "site-packages/pkg/new_b.py")  # 20-byte budget
    manifest = json.loads((more / "manifest.json").read_text())
    assert manifest["extra_files"] == 1 and manifest["extra_bytes"] == 14


def test_copy_key(build_corpus):
    assert build_corpus.copy_key("setuptools/_distutils/version.py") == "version.py"
    assert build_corpus.copy_key("distutils/__init__.py") == "distutils/__init__.py"
