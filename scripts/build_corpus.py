"""Build the training corpus: the Python standard library of the running interpreter, split into
train and held-out sets by file (deterministically, from a hash of the relative path), plus
optionally more Python found on the machine (--extra-root, e.g. site-packages) for training only.

    python scripts/build_corpus.py --out build/corpus
    python scripts/build_corpus.py --out build/corpus_large \
        --extra-root .venv/lib/python3.11/site-packages --extra-bytes 130000000

Writes train.jsonl / heldout.jsonl (one {"path", "text"} per line, sorted by path) and manifest.json
(interpreter version, file counts, bytes, a digest of the whole corpus). site-packages (under the
stdlib root), files that are not UTF-8 and files over --max-bytes are skipped. The held-out split is
the standard library's alone, so it does not change with the extra roots. An extra file is left out
if its text equals a corpus file's or its name could be a copy of a held-out file (same file name;
for __init__.py / __main__.py the same folder too), e.g. setuptools' vendored distutils. The rest
are taken in the order of a hash of their text up to --extra-bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path


def heldout(relpath: str, percent: int) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100 < percent


def python_files(root: Path, max_bytes: int) -> list[tuple[str, str]]:
    """(path relative to root, text) of the UTF-8 *.py files under root, sorted, none under site-packages."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or not path.is_file() or path.stat().st_size > max_bytes or path.stat().st_size == 0:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append((rel, text))
    return files


def copy_key(rel: str) -> str:
    """What two copies of one module share: the file name, and its folder for package markers."""
    parts = rel.split("/")
    return "/".join(parts[-2:]) if parts[-1] in ("__init__.py", "__main__.py") else parts[-1]


def extra_files(roots: list[Path], max_bytes: int, budget: int, seen: set[str], held_keys: set[str]):
    """(training-only files from the extra roots, sorted by path, their total bytes); see the module docstring."""
    candidates = {}
    for root in roots:
        for rel, text in python_files(root, max_bytes):
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest not in seen and copy_key(rel) not in held_keys:
                candidates.setdefault(digest, (f"{root.name}/{rel}", text))
    chosen, total = [], 0
    for digest in sorted(candidates):
        rel, text = candidates[digest]
        size = len(text.encode())
        if budget and total + size > budget:
            continue
        chosen.append((rel, text))
        total += size
    return sorted(chosen), total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/corpus")
    p.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="directory to collect *.py from")
    p.add_argument("--heldout-percent", type=int, default=2)
    p.add_argument("--max-bytes", type=int, default=256 * 1024)
    p.add_argument("--extra-root", action="append", default=[], help="more *.py for training only (repeatable)")
    p.add_argument("--extra-bytes", type=int, default=0, help="at most this many bytes from --extra-root (0: all)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [(rel, text, "heldout" if heldout(rel, args.heldout_percent) else "train")
             for rel, text in python_files(Path(args.root), args.max_bytes)]
    seen = {hashlib.sha256(text.encode()).hexdigest() for _, text, _ in files}
    held_keys = {copy_key(rel) for rel, _, split in files if split == "heldout"}
    extra, extra_bytes = extra_files([Path(r) for r in args.extra_root], args.max_bytes, args.extra_bytes, seen,
                                     held_keys)
    files += [(rel, text, "train") for rel, text in extra]
    digest = hashlib.sha256()
    counts = {"train": [0, 0], "heldout": [0, 0]}
    with open(out / "train.jsonl", "w") as train, open(out / "heldout.jsonl", "w") as held:
        for rel, text, split in files:
            (held if split == "heldout" else train).write(json.dumps({"path": rel, "text": text}) + "\n")
            counts[split][0] += 1
            counts[split][1] += len(text.encode())
            digest.update(rel.encode() + b"\0" + text.encode())
    manifest = {"python": sys.version.split()[0], "root": args.root, "extra_roots": args.extra_root,
                "extra_files": len(extra), "extra_bytes": extra_bytes, "sha256": digest.hexdigest(),
                **{f"{k}_files": v[0] for k, v in counts.items()}, **{f"{k}_bytes": v[1] for k, v in counts.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
