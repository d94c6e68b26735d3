"""Packing and cycle bookkeeping: small pure functions over lists and arrays.

The executor only sequences these; every decision about which owners share a
graph call, which draft path a context takes, how a prompt is chunked and
what a verdict commits is made here and tested with literal arrays
(tests/runtime/test_cycles.py).

Vocabulary (docs/design.md §1, §5):

- *row*: a session's cache row, the same index in the target pool, the draft
  pool and the context pool. A graph over ``n`` owners binds the ``n``
  CONSECUTIVE rows ``first_row .. first_row + n - 1``.
- *frontier*: the target cache holds positions ``0 .. frontier - 1``.
- *draft position*: the draft cache holds context for ``0 .. draft_position - 1``;
  the taps of ``draft_position .. frontier - 1`` are *pending* (on device).
- *block*: ``B`` tokens ``[anchor, MASK × (B-1)]`` at ``frontier .. frontier+B-1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dflash_trt.export import contract as c
from dflash_trt.export.sampling import Sampling, seed_parts
from dflash_trt.runtime.stats import DYNAMIC, STATIC, TARGET


@dataclass(frozen=True)
class RowRun:
    """One graph call: owners at consecutive rows ``first_row .. first_row + len(members) - 1``.

    ``members`` index the caller's owner list, in row order.
    """

    first_row: int
    members: tuple[int, ...]

    @property
    def owners(self) -> int:
        return len(self.members)


def pack_rows(rows: Sequence[int], max_owners: int) -> list[RowRun]:
    """Group owners (given by cache row, any order) into calls of ≤ max_owners consecutive rows.

    A run of consecutive rows longer than ``max_owners`` is split greedily
    (largest calls first); a gap in the rows always starts a new call, since a
    graph over ``n`` owners writes every row it binds.
    """
    assert max_owners >= 1, max_owners
    assert len(set(rows)) == len(rows), f"rows must be distinct, got {list(rows)}"
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    runs: list[RowRun] = []
    members: list[int] = []
    for index in order:
        contiguous = members and rows[index] == rows[members[-1]] + 1
        if members and (not contiguous or len(members) == max_owners):
            runs.append(RowRun(rows[members[0]], tuple(members)))
            members = []
        members.append(index)
    if members:
        runs.append(RowRun(rows[members[0]], tuple(members)))
    return runs


def block_fits(frontier: int, block: int, max_context: int) -> bool:
    """A draft block (and a verify of ≤ B tokens) at ``frontier`` fits the cache.

    Otherwise the session decodes with the plain target (as the reference).
    """
    return frontier + block <= max_context


def cycle_mode(frontier: int, block: int, max_context: int, drained_rows: int) -> str:
    """Which path serves an owner's next token(s): static draft, dynamic drain first, or plain target."""
    if not block_fits(frontier, block, max_context):
        return TARGET
    return DYNAMIC if drained_rows > 0 else STATIC


def cycle_modes(frontiers: Sequence[int], block: int, max_context: int, drained_rows: Sequence[int]) -> list[str]:
    """``cycle_mode`` of each owner, as a list (two scans in the common case: every block fits, none drained)."""
    if frontiers and max(frontiers) + block <= max_context and not any(drained_rows):
        return [STATIC] * len(frontiers)
    return [cycle_mode(f, block, max_context, d) for f, d in zip(frontiers, drained_rows)]


def static_context(draft_positions: Sequence[int], frontiers: Sequence[int], block: int) -> tuple[list[int], list[int]]:
    """(ctx_start, ctx_count) per owner of a static draft_n: the pending rows ``draft_position .. frontier-1``.

    The static graph takes exactly B context rows per owner (the pool row,
    padded past the count); more pending rows than B means a drain was
    skipped — an internal fault, never a user error.
    """
    counts = [f - d for d, f in zip(draft_positions, frontiers)]
    assert all(0 <= n <= block for n in counts), f"pending context rows must be in [0, {block}], got {counts}"
    return list(draft_positions), counts


def chunks(size: int, limit: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces of ``range(size)`` of at most ``limit`` each (prefill and drain chunking)."""
    assert limit >= 1, limit
    return [(lo, min(lo + limit, size)) for lo in range(0, size, limit)]


@dataclass(frozen=True)
class ContextPlan:
    """Where ``pending + new`` tap rows go when new taps are committed for one session.

    Rows are indexed in the concatenation ``[pending rows ; new rows]``: the
    first ``drained`` go through the dynamic draft (``draft_context``, in runs
    of at most ``max_chunk`` rows: the executor's ``_drain`` cuts them) at
    ``draft_position``; ``keep`` rows stay pending in the context pool (at most
    ``block``, so the static draft can take them).
    """

    drained: int
    keep: tuple[int, int]


def plan_context(pending: int, new: int, block: int) -> ContextPlan:
    """Drain all but the last ``block`` rows of ``[pending ; new]``.

    >>> plan_context(3, 20, 8)
    ContextPlan(drained=15, keep=(15, 23))
    """
    assert 0 <= pending <= block and new >= 0, (pending, new, block)
    total = pending + new
    excess = max(0, total - block)
    return ContextPlan(drained=excess, keep=(excess, total))


def trim_context(frontier: int, draft_position: int, position: int) -> tuple[int, int]:
    """Rewind (or clone) to ``position``: (new draft position, pending rows kept).

    Pending taps cover ``draft_position .. frontier - 1``; a rewind keeps the
    first ``position - draft_position`` of them, or none (and pulls the draft
    position back) when ``position`` is before the draft position. Draft cache
    slots past the new draft position are rewritten before they are read.
    """
    assert 0 <= position <= frontier and 0 <= draft_position <= frontier, (position, draft_position, frontier)
    draft = min(draft_position, position)
    return draft, position - draft


class Verdicts(NamedTuple):
    """What one launch's rounds of cycles commit (docs/design.md §1, cycle steps 3–4), as lists."""

    tokens: list[list[int]]  # per owner, its rounds' emitted tokens in order: each round d_1..d_a then y_a (correction or bonus)
    accepted: list[list[int]]  # [rounds][owners] a
    starts: list[list[int]]  # [rounds][owners] the anchor's position (round 0's: the given starts; then the last frontier)
    frontier: list[int]  # per owner, after its last round: the taps of each round's verify rows 0..a became context


def make_verdicts(
    proposals: np.ndarray, accepted: np.ndarray, next_token: np.ndarray, starts: Sequence[int], vocab_size: int
) -> Verdicts:
    """proposals [R, n, P], accepted [R, n], next_token [R, n], starts [n] -> the owners' ``Verdicts`` over
    the launch's R rounds (round r starts where round r - 1 ended: start + a + 1).

    A round's emitted = proposals[:a] + [next] (== choices[:a+1], since an accepted proposal equals the
    target's choice). An out-of-range verdict is a device-side fault, not a user error: ValueError (the
    executor poisons). Lists, not arrays: each owner's tokens end up a list anyway. One round: one
    ``tolist()`` of the proposals, each owner's row cut; several: the owners' tokens of every round taken
    at once (a mask over [n, R, P+1]), then cut per owner, so the work per owner is per launch, not per round.
    """
    rounds, n, width = proposals.shape
    if n and (accepted.min() < 0 or accepted.max() > width or next_token.min() < 0 or next_token.max() >= vocab_size):
        bad = (accepted < 0) | (accepted > width) | (next_token < 0) | (next_token >= vocab_size)
        r, i = (int(x) for x in np.argwhere(bad)[0])
        msg = (f"verdict of owner {i} (round {r}) out of range: accepted {int(accepted[r, i])} (valid [0, {width}]), "
               f"token {int(next_token[r, i])} (valid [0, {vocab_size - 1}])")
        raise ValueError(msg)
    counts = accepted.tolist()
    at = [list(starts)]  # each round's starts
    for a in counts[:-1]:
        at.append([start + x + 1 for start, x in zip(at[-1], a)])
    frontier = [start + x + 1 for start, x in zip(at[-1], counts[-1])]
    if rounds == 1:  # a few dozen owners: lists cost less than array calls
        tokens = proposals[0].tolist()
        for row, a, token in zip(tokens, counts[0], next_token[0].tolist()):  # row i: d_1..d_a, then y_a
            del row[a:]
            row.append(token)
        return Verdicts(tokens, counts, at, frontier)
    by_owner = accepted.T  # [n, R]
    emitted = np.empty((n, rounds, width + 1), dtype=proposals.dtype)
    emitted[:, :, :width] = proposals.transpose(1, 0, 2)
    emitted[np.arange(n)[:, None], np.arange(rounds), by_owner] = next_token.T  # y_a after the a accepted proposals
    flat = emitted[np.arange(width + 1) <= by_owner[:, :, None]].tolist()  # owner by owner, round by round
    tokens, end = [], 0
    for size in (by_owner + 1).sum(axis=1).tolist():
        tokens.append(flat[end : end + size])
        end += size
    return Verdicts(tokens, counts, at, frontier)


def rounds_kept(kept: int, counts: Sequence[int]) -> tuple[int, int]:
    """A lane that finished within a launch, keeping ``kept`` (>= 1) of its rounds' tokens, ``counts[r]`` from
    round r: (how many rounds it kept tokens of, how many it kept of the last one).

    >>> rounds_kept(5, [3, 3, 3]), rounds_kept(3, [3, 3, 3]), rounds_kept(9, [3, 3, 3])
    ((2, 2), (1, 3), (3, 3))
    """
    assert 1 <= kept <= sum(counts), (kept, counts)
    for r, count in enumerate(counts):
        if kept <= count:
            return r + 1, kept
        kept -= count
    raise AssertionError("unreachable: kept <= sum(counts)")


def sampling_rows(samplings: Sequence[Sampling], positions: Sequence[int]) -> dict[str, np.ndarray]:
    """The sampling inputs of ``sample`` / ``verify_sample_{n}`` for one row per (sampling, position).

    ``positions[i]``: the position of the first token row i chooses (a verify
    owner's row j chooses ``positions[i] + j``). The noise of every choice is
    a function of (seed, position, token) only, so output does not depend on
    batching or packing.
    """
    return {
        c.TEMPERATURE: np.array([s.temperature for s in samplings], np.float32),
        c.TOP_K: np.array([s.top_k for s in samplings], np.int64),
        c.TOP_P: np.array([s.top_p for s in samplings], np.float32),
        c.SEED: np.array([seed_parts(s.seed) for s in samplings], np.int64).reshape(len(samplings), c.SEED_PARTS),
        c.POSITION: np.array(positions, np.int64),
    }


def sampling_row(s: Sampling) -> tuple[int, tuple[int, int, int], float, float]:
    """One owner's ``sampling_rows`` values (top_k, seed parts, temperature, top_p), as the same types reach
    the arrays: int64 and float32 columns take them as ``sampling_rows``' arrays hold them."""
    return int(s.top_k), seed_parts(s.seed), float(s.temperature), float(s.top_p)


def prefill_batches(
    lengths: Sequence[int], budget: int, quantum: int, cost: Callable[[int, int], int] | None = None, most: int | None = None
) -> list[tuple[tuple[int, ...], int]]:
    """Prompts of ``lengths`` tokens -> batches (indices, padded length T): one launch each, T a multiple
    of ``quantum``, ``cost(len(indices), T) <= budget`` (a prompt over the budget goes alone), at most
    ``most`` prompts. ``cost``: the tokens a launch of n prompts of T tokens runs (default n · T; a
    launch padded to a captured shape runs more).

    Prompts are taken shortest first, so a batch pads each prompt to about its neighbours' length.

    >>> prefill_batches([5, 40, 7, 33], budget=96, quantum=8)
    [((0, 2), 8), ((3, 1), 40)]
    >>> prefill_batches([5, 7, 6], budget=16, quantum=8, cost=lambda n, T: 8 * n * T)  # padded to 8 owners
    [((0,), 8), ((2,), 8), ((1,), 8)]
    """
    assert budget >= 1 and quantum >= 1, (budget, quantum)
    cost = cost or (lambda n, T: n * T)
    batches: list[tuple[tuple[int, ...], int]] = []
    members: list[int] = []
    width = 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        padded = -(-lengths[index] // quantum) * quantum
        if members and (cost(len(members) + 1, max(width, padded)) > budget or len(members) == most):
            batches.append((tuple(members), width))
            members, width = [], 0
        members.append(index)
        width = max(width, padded)
    if members:
        batches.append((tuple(members), width))
    return batches
