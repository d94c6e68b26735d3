"""Streamed text: incremental detokenization and stop strings.

Tokens arrive a few at a time; the text a client sees must only grow (never
retract a character), so ``TextStream`` releases text only when it is final:

- a token window that decodes to a trailing U+FFFD (an incomplete UTF-8
  sequence of a byte-level BPE) waits for the next token;
- a suffix that could still become a stop string is held back until it cannot.

Decoding uses a sliding window (``prefix``..end against ``prefix``..``read``),
as streaming servers do, so each token costs a decode of a few tokens, not of
the whole completion. The window starts a few tokens back because some
decoders (SentencePiece's leading space) read a token differently at the
start of a text.

A stop string ends the completion where it starts: the released text stops
just before it (OpenAI's ``stop``), and ``push`` says which token completed it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_trt.errors import InputError, TokenizerError

REPLACEMENT = "\ufffd"


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index in ``text`` where the earliest stop string occurrence at or after ``start`` begins."""
    found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
    return min(found) if found else None


class TextStream:
    """Detokenizes one completion incrementally and cuts it at the first stop string.

    ``push(token)`` -> (new final text, stopped). After a stop, further pushes
    are refused (assert: the caller ends the request). ``flush()`` releases
    what was held back when the completion ends for another reason.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.tokens: list[int] = []
        self.prefix = 0  # window start (tokens already decoded, kept for context)
        self.read = 0  # tokens whose text is in ``self.text``
        self.text = ""  # decoded so far (final characters only)
        self.sent = 0  # characters of ``self.text`` released to the caller
        self.stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        assert not self.stopped, "push after a stop string"
        self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self.prefix : self.read])
        after = self.tokenizer.decode(self.tokens[self.prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.tokens)
        return self._release()

    def _release(self) -> tuple[str, bool]:
        # A stop can only begin in unreleased text: a suffix that could start one is never released.
        where = first_stop(self.text, self.stops, self.sent) if self.stops else None
        if where is not None:
            self.text, self.stopped = self.text[:where], True
            end = where
        else:
            end = len(self.text) - held_suffix(self.text[self.sent :], self.stops)
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return delta, self.stopped

    def flush(self) -> str:
        """The rest of the text (held-back stop prefixes, incomplete characters as U+FFFD)."""
        if self.stopped:
            return ""
        self.text += self.tokenizer.decode(self.tokens[self.prefix :])[len(self.tokenizer.decode(self.tokens[self.prefix : self.read])) :]
        self.prefix = self.read = len(self.tokens)
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


def stop_strings(stop: Sequence[str] | str | None, tokenizer) -> tuple[str, ...]:
    """A request's stop strings as a tuple; InputError when one is not a string, TokenizerError without a
    tokenizer (stop strings are matched on the text)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if stops and tokenizer is None:
        raise TokenizerError("stop strings need a tokenizer: pass stop_ids or ServingLoop(tokenizer=...)", param="stop")
    if any(not isinstance(s, str) for s in stops):
        msg = f"stop must be a string or a list of strings, got {stop!r:.80}"
        raise InputError(msg, param="stop")
    return stops


def detokenize(stream: TextStream, tokens: list[int], stopped_by_token: bool) -> tuple[list[int], str, bool]:
    """Push tokens one at a time: (the tokens kept, their new final text, stopped by a stop string).

    A stop string ends the chunk at the token completing it; a stop token that ended the request is
    kept in the tokens but not in the text.
    """
    text = []
    textual = tokens[:-1] if stopped_by_token else tokens
    for i, token in enumerate(textual):
        delta, stopped = stream.push(token)
        text.append(delta)
        if stopped:
            return tokens[: i + 1], "".join(text), True
    return tokens, "".join(text), False
