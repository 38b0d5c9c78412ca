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
