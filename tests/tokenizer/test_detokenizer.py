"""Incremental detokenization: exactly the new text, nothing repeated, incomplete characters and
partial stop strings held back until they resolve."""

from jdspark.tokenizer.tokenizer import Detokenizer


class ByteTokenizer:
    """Token i is byte i: decoding a split multi-byte character yields U+FFFD, as byte-level BPE does."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(detok, blocks):
    return [detok.add(list(block)) for block in blocks] + [detok.finish()]


def test_split_utf8_character_is_held_back():
    data = "aé漢b".encode()
    deltas = stream(Detokenizer(ByteTokenizer()), [data[i:i + 1] for i in range(len(data))])
    assert "".join(deltas) == "aé漢b" and all("\ufffd" not in d for d in deltas)
    assert deltas[1] == ""  # the first byte of é alone is not emitted


def test_whole_blocks_emit_exactly_the_new_text():
    data = "hello world".encode()
    deltas = stream(Detokenizer(ByteTokenizer()), [data[:3], data[3:8], data[8:]])
    assert deltas[:3] == ["hel", "lo wo", "rld"]


def test_partial_stop_string_is_held_then_released_or_cut():
    detok = Detokenizer(ByteTokenizer(), stop=("STOP",))
    assert detok.add(list(b"abST")) == "ab"  # "ST" may start the stop string
    assert detok.add(list(b"x")) == "STx"  # it did not
    detok2 = Detokenizer(ByteTokenizer(), stop=("STOP",))
    deltas = [detok2.add(list(b"abST")), detok2.add(list(b"OPzz"))]
    assert deltas == ["ab", ""] and detok2.stopped and detok2.text == "ab" and detok2.finish() == ""


def test_a_completed_stop_string_keeps_only_the_tokens_that_complete_it():
    detok = Detokenizer(ByteTokenizer(), stop=("STOP",))
    assert detok.add(list(b"abST")) == "ab"
    assert detok.add(list(b"OPzzz")) == "" and detok.stopped
    assert bytes(detok.tokens) == b"abSTOP"  # the three tokens after the stop string are not counted
    whole = Detokenizer(ByteTokenizer(), stop=("b",))
    whole.add(list(b"abc"))
    assert bytes(whole.tokens) == b"ab" and whole.text == "a"


class WholeList(Detokenizer):
    """The oracle: every call decodes the whole list (the Detokenizer before its window)."""

    def _decoded(self):
        return self.tokenizer.decode(self.tokens)


def test_the_window_gives_the_deltas_of_decoding_the_whole_list():
    """The embedded model's tokenizer on code and on random ids (byte tokens that split characters,
    special tokens), in blocks of 1-6 tokens as verify steps emit them, with and without stop strings:
    every delta equals the whole-list oracle's. Mutation caught: the window's settled text not
    subtracted (text repeated)."""
    import pathlib

    import numpy as np

    from jdspark.assets import default_model_dir
    from jdspark.tokenizer.tokenizer import Tokenizer
    tokenizer = Tokenizer(pathlib.Path(default_model_dir()) / "tokenizer.json")
    rng = np.random.default_rng(0)
    code = tokenizer.encode(pathlib.Path(__file__).read_text() + "é漢字 ✓ 😀\n" * 3, add_bos=False)
    vocab = tokenizer.hf.get_vocab_size()
    streams = [code, rng.integers(0, vocab, 400).tolist(),
               [int(t) if rng.random() < 0.7 else int(rng.integers(vocab)) for t in code[:600]]]
    for ids in streams:
        for stop in ((), ("def ", "\n\n"), ("zzz",)):
            cuts = np.cumsum(rng.integers(1, 7, len(ids)))
            blocks = [ids[a:b] for a, b in zip([0, *cuts.tolist()], cuts.tolist()) if a < len(ids)]
            window, whole = Detokenizer(tokenizer, stop), WholeList(tokenizer, stop)
            for block in blocks:
                assert window.add(block) == whole.add(block)
                assert window.tokens == whole.tokens and window.stopped == whole.stopped
                if whole.stopped:
                    break
            assert window.finish() == whole.finish() and window.text == whole.text
