"""Sessions: per-session state, the row allocator, the context pool, batch validation.

A session owns ONE pool row: the same index in the target cache pool, the
draft cache pool and the context pool (pending taps), so a graph over ``n``
owners binds the consecutive rows of their sessions. Per session (docs/design.md §5):

| field | meaning |
| --- | --- |
| frontier | the target cache holds positions ``0 .. frontier - 1`` |
| draft_position | the draft cache holds context for ``0 .. draft_position - 1`` |
| pending rows | ``frontier - draft_position`` taps in the context pool row (≤ B, on device) |
| pending | the emitted token AT position ``frontier`` not yet fed to the target, or None |
| sampling | temperature / top_k / top_p / seed (``export.sampling.Sampling``) |
| poisoned | a failure after mutation left the caches unknown: refused until closed |
| speculate | drafts (DFlash cycles) or plain target decoding only (its taps are never kept) |

``validate_batch`` checks every input of a batch against this state and
returns a plan without touching anything; the executor mutates only after it
returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_trt.checks import is_int
from dflash_trt.errors import DFlashError, InputError, PoisonedError, SessionError
from dflash_trt.export.sampling import GREEDY, SEED_LIMIT, Sampling, check_seed  # noqa: F401  (re-exported)
from dflash_trt.runtime.cycles import block_fits
from dflash_trt.runtime.ownership import RowAllocator



@dataclass
class Session:
    id: int
    row: int
    frontier: int = 0
    draft_position: int = 0
    pending: int | None = None
    sampling: Sampling = GREEDY
    poisoned: bool = False
    drained_rows: int = 0  # context rows drained through the dynamic draft since the last cycle (stats)
    speculate: bool = True  # False: plain target decoding; the draft and the context pool are never used

    @property
    def pending_rows(self) -> int:
        return self.frontier - self.draft_position


@dataclass(frozen=True)
class SessionView:
    """A read-only snapshot of one session (for callers and tests)."""

    id: int
    row: int
    frontier: int
    draft_position: int
    pending: int | None
    sampling: Sampling
    poisoned: bool
    speculate: bool = True


class ContextPool:
    """Pending context taps, on device: ``[rows, block, tap_width]``, one row per session row.

    Allocated once (stable address); a static draft reads its owners' rows
    (``device_loop``: the view of consecutive rows, or a gather at the rows a
    row-indexed program is given). Rows past a session's pending count are
    zero (the static draft's padding).
    """

    def __init__(self, rows: int, block: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block, self.width = block, width
        self.taps = torch.zeros((rows, block, width), dtype=dtype, device=device)

    def rows(self, row: int, count: int) -> torch.Tensor:
        return self.taps[row, :count]  # [count, mH]

    def store(self, row: int, rows: torch.Tensor) -> None:
        """Make ``rows`` [R ≤ B, mH] the row's whole pending context (device copy), zero the rest."""
        count = rows.shape[0]
        self.taps[row, :count].copy_(rows)
        self.taps[row, count:].zero_()

    def copy(self, source: int, destination: int, count: int) -> None:
        self.store(destination, self.taps[source, :count])


class SessionTable:
    """Open sessions by id, their rows taken from the backend's allocator. Ids are never reused."""

    def __init__(self, max_sessions: int, rows: RowAllocator) -> None:
        self.max_sessions = max_sessions
        self.rows = rows  # shared by every executor over the backend
        self.held: set[int] = set()  # rows of this table's sessions
        self.sessions: dict[int, Session] = {}
        self.next_id = 0

    def open(self, speculate: bool = True) -> Session:
        session = Session(self.next_id, self.rows.take(), speculate=speculate)
        self.held.add(session.row)
        self.sessions[session.id] = session
        self.next_id += 1
        return session

    def close(self, session_id: int) -> Session:
        session = self.get(session_id, "session", allow_poisoned=True)
        del self.sessions[session_id]
        self.held.discard(session.row)
        self.rows.give(session.row)
        return session

    def close_all(self) -> None:
        self.sessions.clear()
        self.rows.give_all(self.held)

    def get(self, session_id, what: str = "session", allow_poisoned: bool = False) -> Session:
        """The open session ``session_id``, or the typed error naming ``what``."""
        session = self.sessions.get(session_id) if type(session_id) is int or is_int(session_id, numpy=True) else None
        if session is None:
            msg = f"{what}: unknown or closed session {session_id!r} (open: {sorted(self.sessions)})"
            raise SessionError(msg)
        if session.poisoned and not allow_poisoned:
            msg = f"{what}: session {session_id} is poisoned by an earlier failed batch; close it"
            raise PoisonedError(msg)
        return session

    def room(self, what: str) -> None:
        if len(self.sessions) >= self.max_sessions:
            msg = f"{what}: {len(self.sessions)} sessions open, max_sessions is {self.max_sessions}"
            raise SessionError(msg)


@dataclass(frozen=True)
class Output:
    """What one input produced: its new tokens and, when it cannot go on, why.

    ``finish`` (``runtime.finish``): ``STOP`` (its last token is one of the input's ``stop``),
    ``LENGTH`` (``max_new_tokens`` reached), ``CONTEXT`` (the session's next
    token would sit at ``max_context``), or None (it may continue). For an
    input admitted into a running execute (``Executor.execute_outputs``' admit):
    ``session``, the session opened for it, or ``error``, why it was refused
    (it opened none and ran nothing).
    """

    tokens: list[int]
    finish: str | None = None
    error: DFlashError | None = None
    session: int | None = None


@dataclass(frozen=True)
class Input:
    """One batch input (docs/design.md §5): ``tokens[offset : offset + size]`` at positions from ``position + offset``.

    ``position`` is the position of ``tokens[0]``; None means the session's
    frontier minus ``offset`` (append). ``size`` None means the rest of
    ``tokens``. ``produce_output``: return the target's next token (and run
    a speculative cycle after it).

    ``max_new_tokens`` None: one step, as the seed's executor (the target's
    prediction and at most one cycle). An int N lets the executor run several
    cycles (or plain decode steps) in this call and return up to N tokens,
    through the first of ``stop`` (kept); tokens it computed past that are
    discarded and the session rewound, so the output equals the one-step
    calls'. Only with ``produce_output``.
    """

    session: int
    tokens: Sequence[int]
    offset: int = 0
    size: int | None = None
    position: int | None = None
    produce_output: bool = True
    max_new_tokens: int | None = None
    stop: Sequence[int] = ()


@dataclass
class Step:
    """A validated input: what the executor will run for it."""

    index: int  # in the batch
    session: Session
    tokens: list[int]
    start: int  # position of tokens[0]
    rewind: bool  # start < frontier: rewind to start first (first input of its session only)
    produce_output: bool
    last: bool = False  # the session's last input in the batch (may seed a cycle)
    fast: bool = False  # exactly the session's pending token: skip the target, speculate at once
    decode: bool = False  # one token, no speculation from it: a plain decode step (target_decode_n)
    room: int | None = None  # max_new_tokens (None: one step)
    stop: frozenset[int] = frozenset()

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Limits:
    vocab_size: int
    max_context: int
    block: int


_FIELDS = ("session", "tokens", "offset", "size", "position", "produce_output", "max_new_tokens", "stop")


def validate_batch(table: SessionTable, batch, limits: Limits) -> list[Step]:
    """Check every input against the sessions' state; return the plan. Mutates nothing.

    Raises SessionError / PoisonedError (session), InputError (anything
    else), each naming ``input[i].field``, the valid range and the value.
    """
    if not isinstance(batch, (list, tuple)) or not batch:
        msg = f"batch must be a non-empty list of inputs, got {batch!r:.80}"
        raise InputError(msg)
    cursors: dict[int, int] = {}  # session id -> end of its previous input in this batch
    steps = []
    for i, item in enumerate(batch):
        step = _plain_step(i, item, table, limits, cursors) if type(item) is Input else None
        steps.append(step if step is not None else _validate_input(i, _as_input(i, item), table, limits, cursors))
    _mark_last_and_fast(steps, limits)
    return steps


def _plain_step(index: int, item: Input, table: SessionTable, limits: Limits, cursors: dict[int, int]) -> Step | None:
    """``_validate_input``'s step for the common input (a serving loop's: a list of plain int tokens
    appended at its session's cursor, no offset, size or position; ``max_new_tokens`` None or an int;
    ``stop`` a tuple or list of plain ints), checked without building the field names its errors
    would need; None for any other input, valid or not: ``_validate_input`` checks it and names what
    is wrong. Mutates nothing but ``cursors``, and only when it returns a step."""
    session = table.sessions.get(item.session) if type(item.session) is int else None
    tokens, stop, room, produce = item.tokens, item.stop, item.max_new_tokens, item.produce_output
    if (
        session is None
        or session.poisoned
        or type(tokens) is not list
        or not _plain_ids(tokens, limits.vocab_size)
        or type(stop) not in (tuple, list)
        or (stop and not _plain_ids(stop, limits.vocab_size))
        or type(item.offset) is not int
        or item.offset != 0
        or item.size is not None
        or item.position is not None
        or type(produce) is not bool
        or (room is not None and (type(room) is not int or room < 1 or not produce))
    ):
        return None
    start = cursors.get(session.id, session.frontier)  # the session's frontier, or its previous input's end
    if start + len(tokens) > limits.max_context:
        return None
    cursors[session.id] = start + len(tokens)
    return Step(index, session, tokens[:], start, False, produce, room=room, stop=frozenset(stop))


def _plain_ids(values: list | tuple, vocab_size: int) -> bool:
    """A non-empty list or tuple of plain ints (bools are not) in [0, vocab_size), checked at C speed."""
    return bool(values) and set(map(type, values)) <= {int} and min(values) >= 0 and max(values) < vocab_size


def _as_input(index: int, item) -> Input:
    if isinstance(item, Input):
        return item
    if isinstance(item, dict):
        extra = sorted(set(item) - set(_FIELDS))
        if extra or "session" not in item or "tokens" not in item:
            msg = f"input[{index}]: fields must be {_FIELDS} (session, tokens required), got {sorted(item)}"
            raise InputError(msg)
        return Input(**item)
    msg = f"input[{index}] must be an Input or a dict of {_FIELDS}, got {type(item).__name__}"
    raise InputError(msg)


def _validate_input(index: int, item: Input, table: SessionTable, limits: Limits, cursors: dict[int, int]) -> Step:
    where = f"input[{index}]"
    session = table.get(item.session, f"{where}.session")
    tokens = token_ids(f"{where}.tokens", item.tokens, limits.vocab_size)
    offset = int_in(f"{where}.offset", item.offset, 0, len(tokens))
    size = len(tokens) - offset if item.size is None else item.size
    size = int_in(f"{where}.size", size, 1, len(tokens) - offset, "(tokens after offset)")
    first = session.id not in cursors
    cursor = cursors.get(session.id, session.frontier)
    position = cursor - offset if item.position is None else item.position
    position = int_in(f"{where}.position", position, -offset, None, "(position + offset >= 0)")
    start = position + offset
    if first and start > session.frontier:
        msg = f"{where}.position: position + offset must be in [0, {session.frontier}] (session {session.id}'s frontier), got {start}"
        raise InputError(msg)
    if not first and start != cursor:
        msg = f"{where}.position: a repeated session's input must continue at {cursor} (its previous input's end), got {start}"
        raise InputError(msg)
    if start + size > limits.max_context:
        msg = f"{where}.size: position + offset + size must be <= max_context {limits.max_context}, got {start + size}"
        raise InputError(msg)
    if not isinstance(item.produce_output, (bool, np.bool_)):
        msg = f"{where}.produce_output must be a bool, got {item.produce_output!r}"
        raise InputError(msg)
    room = None if item.max_new_tokens is None else int_in(f"{where}.max_new_tokens", item.max_new_tokens, 1, None)
    if room is not None and not item.produce_output:
        msg = f"{where}.max_new_tokens needs produce_output=True (an input without output returns no tokens), got {room}"
        raise InputError(msg)
    stop = frozenset(token_ids(f"{where}.stop", item.stop, limits.vocab_size))
    cursors[session.id] = start + size
    chosen = tokens[offset : offset + size]
    rewind = first and start < session.frontier
    return Step(index, session, chosen, start, rewind, bool(item.produce_output), room=room, stop=stop)


def token_ids(where: str, tokens, vocab_size: int) -> list[int]:
    """``tokens`` as plain ints, each in [0, vocab_size): a list, tuple or range of ints (numpy ints
    too), or a 1-D numpy array / torch tensor. Anything else (str, dict, set, generator...) is refused:
    a dict would give its keys, a set an arbitrary order."""
    if isinstance(tokens, (np.ndarray, torch.Tensor)):
        if tokens.ndim != 1:
            msg = f"{where} must be a 1-D sequence of token ids, got an array of shape {list(tokens.shape)}"
            raise InputError(msg)
        values = tokens.tolist()  # plain Python scalars (floats and bools stay so, and are refused below)
    elif isinstance(tokens, (list, tuple, range)):
        values = list(tokens)
    else:
        msg = f"{where} must be a list, tuple or 1-D integer array of token ids, got {type(tokens).__name__}"
        raise InputError(msg)
    if not values or _plain_ids(values, vocab_size):
        return values  # plain ints in range: the common case, checked at C speed (bools are not of type int)
    for j, token in enumerate(values):
        if not is_int(token, numpy=True) or not 0 <= int(token) < vocab_size:
            msg = f"{where}[{j}] must be a token id (an int) in [0, {vocab_size - 1}], got {token!r}"
            raise InputError(msg)
    return [int(token) for token in values]


def int_in(name: str, value, low: int, high: int | None, note: str = "") -> int:
    if type(value) is int and low <= value and (high is None or value <= high):
        return value  # the common case, without the ABC check (bools are not of type int)
    if not is_int(value, numpy=True) or int(value) < low or (high is not None and int(value) > high):
        valid = f"in [{low}, {high}]" if high is not None else f">= {low}"
        msg = f"{name} must be an int {valid}{' ' + note if note else ''}, got {value!r}"
        raise InputError(msg)
    return int(value)


def _mark_last_and_fast(steps: list[Step], limits: Limits) -> None:
    """``last``: the session's final input; ``fast``: its only input, exactly its pending token, and
    the session drafts with room for a block; ``decode``: its only input, one token, that will not
    seed a cycle (the session does not speculate, or no block fits): a plain decode step."""
    ids = [step.session.id for step in steps]
    count: dict[int, int] | None = None  # None: every session's only input (a serving loop's batch)
    if len(set(ids)) < len(ids):
        count = {}
        for sid in ids:
            count[sid] = count.get(sid, 0) + 1
    seen: dict[int, int] = {}
    for step, sid in zip(steps, ids):
        if count is None:
            step.last, alone = True, True
        else:
            seen[sid] = seen.get(sid, 0) + 1
            step.last, alone = seen[sid] == count[sid], count[sid] == 1
        s = step.session
        single = alone and step.produce_output and len(step.tokens) == 1
        drafts = s.speculate and block_fits(step.start, limits.block, limits.max_context)
        step.fast = single and drafts and step.start == s.frontier and s.pending == step.tokens[0]
        step.decode = single and not drafts
