"""Packing and cycle bookkeeping on literal arrays (runtime/cycles.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.errors import SessionError
from dflash_trt.export import contract as c
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.cycles import (
    DYNAMIC,
    STATIC,
    TARGET,
    ContextPlan,
    RowRun,
    block_fits,
    chunks,
    cycle_mode,
    cycle_modes,
    make_verdicts,
    pack_rows,
    plan_context,
    prefill_batches,
    rounds_kept,
    static_context,
    sampling_rows,
    trim_context,
)
from dflash_trt.runtime.ownership import RowAllocator


def test_pack_rows_splits_at_gaps_and_max_owners():
    """Guards against packing non-adjacent rows into one call (a graph binds first..first+n-1 and would write a stranger's row)."""
    rows = [5, 0, 1, 2, 7, 3, 4, 9]
    groups = pack_rows(rows, 4)
    assert groups == [RowRun(0, (1, 2, 3, 5)), RowRun(4, (6, 0)), RowRun(7, (4,)), RowRun(9, (7,))]
    for group in groups:
        assert [rows[m] for m in group.members] == list(range(group.first_row, group.first_row + group.owners))


def test_pack_rows_single_owner_calls_and_empty():
    """Guards against max_owners=1 merging rows, and against an empty ready set producing a call."""
    assert pack_rows([3, 2], 1) == [RowRun(2, (1,)), RowRun(3, (0,))]
    assert pack_rows([], 4) == []


def test_pack_rows_refuses_duplicate_rows():
    """Guards against one session being packed twice into one call (two cycles on one cache row)."""
    with pytest.raises(AssertionError):
        pack_rows([1, 1], 4)


def test_block_fits_and_mode():
    """Guards against drafting a block past the cache end (the reference falls back to plain decode when start + B > max_context)."""
    assert block_fits(56, 8, 64) and not block_fits(57, 8, 64)
    assert cycle_mode(56, 8, 64, 0) == STATIC
    assert cycle_mode(10, 8, 64, 30) == DYNAMIC
    assert cycle_mode(57, 8, 64, 0) == TARGET


def test_static_context():
    """Guards against a static draft fed more than B pending rows (a skipped drain) or the wrong start."""
    assert static_context([10, 0, 33], [14, 8, 33], 8) == ([10, 0, 33], [4, 8, 0])
    with pytest.raises(AssertionError, match="pending context rows"):
        static_context([0], [9], 8)


def test_chunks():
    """Guards against a dropped or overlapping prefill/drain chunk."""
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(4, 4) == [(0, 4)]
    assert chunks(0, 4) == []


def test_plan_context_drains_all_but_one_block():
    """Guards against static-draft context overflow (> B pending rows) and against draining rows the static draft could take."""
    assert plan_context(3, 20, 8) == ContextPlan(drained=15, keep=(15, 23))
    assert plan_context(2, 4, 8) == ContextPlan(drained=0, keep=(0, 6))
    assert plan_context(8, 1, 8) == ContextPlan(drained=1, keep=(1, 9))
    assert plan_context(0, 8, 8).drained == 0 and plan_context(5, 8, 8).drained == 5


def test_trim_context():
    """Guards against a rewind keeping stale pending taps past the new frontier (pending taps must be trimmed to the rewind position)."""
    # pending covers 10..14 (draft at 10, frontier 15)
    assert trim_context(15, 10, 12) == (10, 2)
    assert trim_context(15, 10, 15) == (10, 5)
    assert trim_context(15, 10, 10) == (10, 0)
    assert trim_context(15, 10, 4) == (4, 0)  # before the draft position: pull it back
    assert trim_context(15, 10, 0) == (0, 0)


def test_make_verdicts():
    """Guards against off-by-one in emitted tokens (choices[:a+1]) and the new frontier (start + a + 1)."""
    proposals = np.array([[[11, 12, 13], [21, 22, 23], [31, 32, 33]]])
    verdicts = make_verdicts(proposals, np.array([[0, 2, 3]]), np.array([[40, 50, 60]]), [100, 7, 0], vocab_size=97)
    assert verdicts.tokens == [[40], [21, 22, 50], [31, 32, 33, 60]]
    assert verdicts.accepted == [[0, 2, 3]]
    assert verdicts.starts == [[100, 7, 0]]
    assert verdicts.frontier == [101, 10, 4]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_make_verdicts_equal_the_per_owner_rule_round_by_round(data):
    """Guards against the launch-wide form of the verdicts drifting from the rule per owner and round (emitted =
    proposals[:a] + [next], the next round starting at start + a + 1): a cut at the wrong place, in another
    owner's row or another round's would hand an owner another's token, keep a rejected proposal or put a
    round's tokens out of order; one round and several (the mask over [owners, rounds, P+1]) alike."""
    rounds, n, width = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 9)), data.draw(st.integers(1, 6))
    proposals = np.array(data.draw(st.lists(st.integers(0, 96), min_size=rounds * n * width, max_size=rounds * n * width))).reshape(rounds, n, width)
    accepted = np.array(data.draw(st.lists(st.integers(0, width), min_size=rounds * n, max_size=rounds * n))).reshape(rounds, n)
    tokens = np.array(data.draw(st.lists(st.integers(0, 96), min_size=rounds * n, max_size=rounds * n))).reshape(rounds, n)
    starts = data.draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    verdicts = make_verdicts(proposals, accepted, tokens, starts, vocab_size=97)
    expected_tokens, expected_starts, at = [[] for _ in range(n)], [], list(starts)
    for r in range(rounds):
        expected_starts.append(list(at))
        for i in range(n):
            a = int(accepted[r, i])
            expected_tokens[i] += [*proposals[r, i, :a].tolist(), int(tokens[r, i])]
            at[i] += a + 1
    assert verdicts.tokens == expected_tokens
    assert verdicts.accepted == accepted.tolist()
    assert verdicts.starts == expected_starts
    assert verdicts.frontier == at


def test_rounds_kept_finds_the_round_a_lane_finished_in():
    """Guards against a lane that finished inside a launch of several rounds being counted in a round after
    its last kept token (its stats and acceptance would count a discarded cycle) or not in the one holding it,
    and against its last round's emitted count (the tokens kept of it) off by one."""
    assert rounds_kept(5, [3, 3, 3]) == (2, 2)
    assert rounds_kept(3, [3, 3, 3]) == (1, 3)
    assert rounds_kept(1, [3, 3, 3]) == (1, 1)
    assert rounds_kept(9, [3, 3, 3]) == (3, 3)
    assert rounds_kept(4, [1, 1, 1, 1]) == (4, 1)
    for counts in ([2, 5, 1], [1], [4, 4]):
        for kept in range(1, sum(counts) + 1):
            until, last = rounds_kept(kept, counts)
            assert sum(counts[: until - 1]) + last == kept and 1 <= last <= counts[until - 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 70), st.integers(0, 3)), min_size=1, max_size=12))
def test_cycle_modes_equal_cycle_mode(owners):
    """Guards against the per-launch modes (two scans when all are static) disagreeing with
    ``cycle_mode`` per owner, e.g. a drained owner reported static or a full one not as target."""
    frontiers, drained = (list(column) for column in zip(*owners))
    assert cycle_modes(frontiers, 8, 64, drained) == [cycle_mode(f, 8, 64, d) for f, d in owners]


@pytest.mark.parametrize("accepted, token", [(4, 1), (-1, 1), (1, 97), (1, -2)])
def test_make_verdicts_refuses_bad_verdicts(accepted, token):
    """Guards against committing a corrupted device verdict (must fail and poison, not emit garbage)."""
    with pytest.raises(ValueError, match="verdict of owner 0"):
        make_verdicts(np.array([[[1, 2, 3]]]), np.array([[accepted]]), np.array([[token]]), [0], vocab_size=97)


def test_sampling_rows_split_the_seed_and_keep_the_positions():
    """Guards against a seed that loses bits on its way into the graph (a 64-bit seed must enter as
    three int64 parts < 2**22 the hash absorbs exactly) or rows whose parameters are swapped."""
    seed = 0xFEDC_BA98_7654_3210
    rows = sampling_rows([Sampling(0.5, 7, 0.9, seed), Sampling(seed=1)], [11, 4])
    assert rows[c.TEMPERATURE].tolist() == [0.5, 0.0] and rows[c.TEMPERATURE].dtype == np.float32
    assert rows[c.TOP_K].tolist() == [7, 0] and rows[c.TOP_P].tolist() == [np.float32(0.9), 1.0]
    parts = rows[c.SEED]
    assert parts.shape == (2, c.SEED_PARTS) and parts.dtype == np.int64 and (parts < 2**22).all()
    assert sum(int(p) << (22 * i) for i, p in enumerate(parts[0])) == seed and parts[1].tolist() == [1, 0, 0]
    assert rows[c.POSITION].tolist() == [11, 4]
    assert sampling_rows([], [])[c.SEED].shape == (0, c.SEED_PARTS)


def rule(rows: int, used: set[int]) -> int:
    """The row the allocator must pick, by brute force: the free row with most used neighbours, then lowest."""
    free = [row for row in range(rows) if row not in used]
    return min(free, key=lambda row: (-((row - 1 in used) + (row + 1 in used)), row))


def holding(rows: int, used: set[int]) -> RowAllocator:
    """An allocator of ``rows`` rows with exactly ``used`` in use (every row taken, the others given back)."""
    allocator = RowAllocator(rows)
    for _ in range(rows):
        allocator.take()
    for row in set(range(rows)) - used:
        allocator.give(row)
    return allocator


def test_the_row_allocator_keeps_runs_consecutive():
    """Guards against fragmenting the pool (scattered rows force one graph call per owner), and against the
    incremental choice (no pass over every row) choosing another row than the rule's brute force: most used
    neighbours, then lowest, over every used set of 7 rows and random ones of 129."""
    assert holding(4, set()).take() == 0
    assert holding(8, {0, 1, 2, 5, 6}).take() == 3  # each extends a run: lowest
    assert holding(9, {0, 1, 2, 4, 5, 6}).take() == 3  # fills a one-row gap: two runs become one
    assert holding(13, {10, 11}).take() == 9  # extends a run, lowest first
    assert holding(31, {0}).take() == 1 and holding(31, {30}).take() == 29
    for mask in range(2**7 - 1):  # every used set of 7 rows but the full one
        used = {row for row in range(7) if mask >> row & 1}
        assert holding(7, used).take() == rule(7, used), used
    generator = np.random.default_rng(0)
    for _ in range(300):
        used = set(generator.choice(129, size=int(generator.integers(1, 129)), replace=False).tolist())
        assert holding(129, used).take() == rule(129, used), sorted(used)


def test_the_row_allocator_picks_the_rule_s_row_through_takes_and_gives():
    """Guards against the allocator's incremental bookkeeping (free rows by used neighbours, updated per take
    and give) drifting from the rule it keeps: every take must be the rule's choice over the rows in use,
    through random takes, gives, repeated gives and whole-set returns, pools of 1 to 40 rows."""
    generator = np.random.default_rng(1)
    for rows in (1, 2, 3, 7, 40):
        allocator = RowAllocator(rows)
        for _ in range(400):
            if len(allocator.used) < rows and generator.random() < 0.55:
                expected = rule(rows, set(allocator.used))
                assert allocator.take() == expected, (rows, sorted(allocator.used))
            elif allocator.used and generator.random() < 0.95:
                row = int(generator.choice(sorted(allocator.used)))
                allocator.give(row)
                allocator.give(row)  # a second give of a free row changes nothing
            elif allocator.used:
                held = set(generator.choice(sorted(allocator.used), size=int(generator.integers(1, len(allocator.used) + 1)), replace=False).tolist())
                allocator.give_all(held)
                assert not held
        while len(allocator.used) < rows:  # filled to the last row, each still the rule's choice
            expected = rule(rows, set(allocator.used))
            assert allocator.take() == expected
        with pytest.raises(SessionError, match=f"every cache row of the backend is in use \\({rows} rows\\)"):
            allocator.take()


def test_prefill_batches_respect_the_token_budget_and_pad_to_neighbours():
    """Guards against a batched prefill launch larger than its token budget (padding included), a
    prompt left out or taken twice, and padding short prompts to a long one's length."""
    lengths = [5, 40, 7, 33, 100, 1, 64]
    batches = prefill_batches(lengths, budget=96, quantum=8)
    assert sorted(i for members, _ in batches for i in members) == list(range(len(lengths)))
    for members, width in batches:
        assert width % 8 == 0 and width >= max(lengths[i] for i in members)
        assert len(members) * width <= 96 or len(members) == 1  # a prompt past the budget goes alone
    assert batches[0] == ((5, 0, 2), 8)  # the short ones together
    assert prefill_batches([], 96, 8) == []
    padded = prefill_batches([5] * 6, budget=32, quantum=8, cost=lambda n, T: (1 << (n - 1).bit_length()) * T)  # owners to 2^k
    assert [members for members, _ in padded] == [(0, 1, 2, 3), (4, 5)]  # 5 owners would launch as 8: over budget
