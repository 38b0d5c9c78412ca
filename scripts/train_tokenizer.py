"""Train the embedded model's byte-level BPE tokenizer on the corpus and tokenize the corpus.

    python scripts/train_tokenizer.py --corpus build/corpus --vocab 8192 \
        --out jdspark/assets/tiny-code/tokenizer.json

Ids 0 and 1 are DSV4's BOS and EOS; then the DSpark noise token (the drafter's masked-position
input), a pad token, and DSV4's chat / tool tokens (spec dsv4.md §8) so that real prompts in the
DSV4 format tokenize with single ids. Writes train.npy / heldout.npy (uint16 ids; every file is
BOS + text + EOS) next to the corpus. With --existing PATH no tokenizer is trained: the corpus is
tokenized with PATH (a larger corpus for the same shipped tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
NOISE, PAD = "<｜dspark▁noise｜>", "<｜▁pad▁｜>"
CONTROL = [BOS, EOS, NOISE, PAD]  # special: never produced from text, dropped when decoding
CHAT = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜latest_reminder｜>", "<｜action｜>",
        "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>", "<｜DSML｜",
        "<tool_result>", "</tool_result>"]  # added tokens that decode as text (the chat parser reads them)


def documents(path: Path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


def train(corpus: Path, vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(CHAT), special_tokens=CONTROL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents(corpus / "train.jsonl"), trainer)
    tok.add_tokens(CHAT)
    return tok


def encode_split(tok: Tokenizer, path: Path) -> np.ndarray:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    texts = list(documents(path))
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return np.asarray(ids, np.uint16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="build/corpus")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--out", default="jdspark/assets/tiny-code/tokenizer.json")
    p.add_argument("--existing", default=None, help="tokenize with this tokenizer.json instead of training one")
    args = p.parse_args(argv)
    corpus, out = Path(args.corpus), Path(args.out)
    if args.existing:
        tok = Tokenizer.from_file(args.existing)
    else:
        tok = train(corpus, args.vocab)
        out.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out))
    assert [tok.token_to_id(t) for t in CONTROL] == [0, 1, 2, 3], "control tokens must be ids 0..3"
    stats = {"vocab_size": tok.get_vocab_size(), "noise_token_id": tok.token_to_id(NOISE)}
    for split in ("train", "heldout"):
        ids = encode_split(tok, corpus / f"{split}.jsonl")
        np.save(corpus / f"{split}.npy", ids)
        nbytes = sum(len(t.encode()) for t in documents(corpus / f"{split}.jsonl"))
        stats[f"{split}_tokens"] = int(ids.size)
        stats[f"{split}_bytes_per_token"] = round(nbytes / ids.size, 3)
    (corpus / "tokenizer_stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
