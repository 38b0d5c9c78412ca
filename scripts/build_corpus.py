"""Build the training corpus: the Python standard library of the running interpreter, split into
train and held-out sets by file (deterministically, from a hash of the relative path).

    python scripts/build_corpus.py --out build/corpus

Writes train.jsonl / heldout.jsonl (one {"path", "text"} per line, sorted by path) and manifest.json
(interpreter version, file counts, bytes, a digest of the whole corpus). site-packages, files that
are not UTF-8 and files over --max-bytes are skipped.
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


def stdlib_files(root: Path, max_bytes: int) -> list[tuple[str, str]]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or path.stat().st_size > max_bytes or path.stat().st_size == 0:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append((rel, text))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/corpus")
    p.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="directory to collect *.py from")
    p.add_argument("--heldout-percent", type=int, default=2)
    p.add_argument("--max-bytes", type=int, default=256 * 1024)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(Path(args.root), args.max_bytes)
    digest = hashlib.sha256()
    counts = {"train": [0, 0], "heldout": [0, 0]}
    with open(out / "train.jsonl", "w") as train, open(out / "heldout.jsonl", "w") as held:
        for rel, text in files:
            split = "heldout" if heldout(rel, args.heldout_percent) else "train"
            (held if split == "heldout" else train).write(json.dumps({"path": rel, "text": text}) + "\n")
            counts[split][0] += 1
            counts[split][1] += len(text.encode())
            digest.update(rel.encode() + b"\0" + text.encode())
    manifest = {"python": sys.version.split()[0], "root": args.root, "sha256": digest.hexdigest(),
                **{f"{k}_files": v[0] for k, v in counts.items()}, **{f"{k}_bytes": v[1] for k, v in counts.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
