"""Streamed detokenization and stop strings (runtime.serving.text) with the default pair's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from dflash_trt.export.tokenizer import Tokenizer
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from dflash_trt.runtime.serving.text import TextStream, first_stop, held_suffix

TEXT = "def grüße(x):\n    return '✓ naïve — 日本' + x  # done\n"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")


def stream_all(tokenizer, ids, stops=()):
    """(deltas, stopped at token index or None) pushing ids one at a time."""
    stream, deltas = TextStream(tokenizer, stops), []
    for i, token in enumerate(ids):
        delta, stopped = stream.push(token)
        deltas.append(delta)
        if stopped:
            return deltas, i
    deltas.append(stream.flush())
    return deltas, None


def test_pure_helpers_on_literals():
    """Guards against releasing a suffix that could still start a stop string, or missing the earliest stop."""
    assert held_suffix("abc", ["cd", "bcx"]) == 2
    assert held_suffix("abc", ["abc"]) == 0  # a whole stop is a match, not a prefix
    assert held_suffix("", ["a"]) == 0 and held_suffix("xyz", []) == 0
    assert first_stop("a STOP b END", ["END", "STOP"], 0) == 2
    assert first_stop("a STOP b END", ["END", "STOP"], 3) == 9
    assert first_stop("abc", ["x"], 0) is None


def test_deltas_concatenate_to_the_full_decode_and_never_hold_broken_characters(tokenizer):
    """Guards against streamed text differing from decoding the whole completion (multi-byte characters
    split across byte-level tokens released as U+FFFD, or characters dropped/duplicated at window edges)."""
    ids = tokenizer.encode(TEXT)
    deltas, stopped = stream_all(tokenizer, ids)
    assert stopped is None and "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some byte tokens did wait for their character


@pytest.mark.parametrize("stop", ["return", "✓ na", "日本", "\n    ", "x):"])
def test_stop_string_cuts_text_before_it_at_the_completing_token(tokenizer, stop):
    """Guards against a stop string that spans tokens being missed, text after (or of) the stop being
    released, or the request not ending at the token that completed the stop."""
    ids = tokenizer.encode(TEXT)
    deltas, at = stream_all(tokenizer, ids, [stop, "never-there"])
    assert at is not None
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]
    assert stop in tokenizer.decode(ids[: at + 1]) and stop not in tokenizer.decode(ids[:at])


def test_held_prefix_of_a_stop_that_never_completes_is_released_at_flush(tokenizer):
    """Guards against losing text held back as a possible stop prefix when the completion ends first."""
    ids = tokenizer.encode("value = 12")
    deltas, at = stream_all(tokenizer, ids, ["12345"])
    assert at is None and "".join(deltas) == "value = 12" and deltas[-1].endswith("12")
