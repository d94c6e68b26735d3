"""Stats that tell the truth: failed batches leave no cycle rows, refusals leave no rows, the log is bounded."""

from __future__ import annotations

from dataclasses import replace

import polars as pl
import pytest

from dflash_trt.analysis.counters import cross_check
from dflash_trt.analysis.load import scan_run
from dflash_trt.errors import InputError, PoisonedError
from dflash_trt.runtime.executor import Executor, Input
from dflash_trt.runtime.sessions import Session
from dflash_trt.runtime.stats import COUNTERS, StatsLog
from executor_fixtures import RecordingBackend


TINY_ROWS = 6  # cache rows of the module's Tiny (conftest)


def test_failed_batch_leaves_no_cycle_rows_and_refusals_leave_no_rows(tiny):
    """Guards against a failed batch's completed groups (prompt rows, a first verify group that ran
    before a later group failed) staying in the log and counting toward τ and the totals, and against
    a refused call appending an execute row and advancing batch_id."""
    executor = Executor(backend := RecordingBackend(tiny.ort), tiny.dims, 5)
    sessions = [executor.open_session() for _ in range(5)]
    executor.execute([Input(s, [3 + s, 9, 4]) for s in sessions[:4]])
    executor.execute([Input(s, [executor.session(s).pending]) for s in sessions[:4]])
    good_cycles, good_executes = executor.cycle_stats(), executor.execute_stats()
    with pytest.raises(InputError):
        executor.execute([Input(sessions[0], [executor.session(sessions[0]).pending]), Input(sessions[1], [10**6])])
    assert executor.execute_stats().equals(good_executes) and executor.refused_calls() == {"execute": 1}
    # 4 owners at consecutive rows, max_owners 3: two groups; the second group's verdict fails.
    backend.fail_on = ("verify_argmax", backend.counts["verify_argmax"] + 2)
    with pytest.raises(PoisonedError):
        executor.execute([Input(s, [executor.session(s).pending]) for s in sessions[:4]] + [Input(sessions[4], [1, 2])])
    assert backend.counts["verify_argmax"] >= 2  # the first group did complete
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    assert cycles.equals(good_cycles)  # neither the first group's cycle rows nor session 4's prompt row
    failed = executes.row(-1, named=True)
    assert failed["batch_id"] == 2 and not failed["ok"] and failed["failed_batches"] == 1
    assert all(failed[name] == 0 for name in COUNTERS if name != "failed_batches")
    assert executes["batch_id"].to_list() == [0, 1, 2]
    check = cross_check(cycles.lazy(), executes.lazy()).collect()
    assert check["match"].all(), check


def _log_batches(log: StatsLog, sizes: list[int]) -> None:
    session = Session(0, 0)
    for size in sizes:
        log.begin()
        for position in range(size):
            log.target_row(session, position, 0.5)
        log.counters["target_decode_steps"] += size
        log.commit(1, size, False)


def test_target_rows_in_one_append_equal_one_target_row_per_session():
    """Guards against the bulk prompt rows of a prefill launch (``target_rows``) sharing one cycle id,
    misaligning a column, or charging the host time to every row: they must equal ``target_row`` called
    per session (timing aside), and only their first row may carry host time."""
    sampled = Session(7, 3)
    sampled.sampling = replace(sampled.sampling, temperature=0.7)
    sessions, positions = [Session(4, 1), sampled, Session(9, 0)], [11, 3, 25]
    one, bulk = StatsLog(), StatsLog()
    for log in (one, bulk):
        log.begin()
        log.target_row(Session(2, 2), 5, 0.25)  # a row before: cycle ids go on from it
    for s, position in zip(sessions, positions):
        one.target_row(s, position, 0.0)
    bulk.target_rows(sessions, positions, 0.0)  # no device time: the first row's host time is > 0
    for log in (one, bulk):
        log.commit(4, 4, False)
    timing = ["host_ms", "end_ms"]
    expected, got = one.frames()[0], bulk.frames()[0]
    assert got.drop(timing).equals(expected.drop(timing)), (got, expected)
    assert got["cycle_id"].to_list() == [0, 1, 2, 3] and got["end_ms"][1:].n_unique() == 1
    assert got["host_ms"][2:].to_list() == [0.0, 0.0] and got["host_ms"][1] > 0.0


def test_a_log_without_the_cycle_table_counts_every_execute_row_alike():
    """Guards against a server's stats (its executor keeps no cycle rows: ``cycle_table=False``, nobody
    reads them there) losing a count its metrics read from the execute rows: the policy's cycles, decodes
    and verified proposals, the decode steps, every counter, must equal a full log's over the same rows,
    whatever mix of choices (the policy's, fixed) a launch's rows carry; only the cycles table stays empty."""
    from dflash_trt.runtime.policy import Choice

    estimate, probe = Choice("cycle", "estimate", 1.4, "cycle", 16, 7), Choice("decode", "probe", 0.9, "decode", 16)
    sessions = [Session(i, i) for i in range(4)]
    full, lean = StatsLog(), StatsLog(cycle_table=False)
    for log in (full, lean):
        log.begin()
        log.target_rows(sessions, [5, 6, 7, 8], 0.1)
        log.cycle_counters(4, 7, 9, [3, 7, 0, 2], 64)
        log.cycle_rows(sessions, ["static"] * 4, [2, 2, 3, 2], [3, 7, 0, 2], [4, 8, 1, 3], [5, 6, 7, 8], 7, 0.0, 0.3, choices=[estimate] * 4)
        log.cycle_rows(sessions[:3], ["static"] * 3, [1, 1, 1], [1, 0, 2], [2, 1, 3], [9, 14, 8], 15, 0.0, 0.3, choices=[estimate, None, estimate])
        log.decode_rows(sessions, 0.2, choices=[probe, probe, None, probe])
        log.decode_rows(sessions[:2], 0.2)
        log.commit(4, 20, False)
    timing = ["wall_ms", "end_ms"]
    assert lean.frames()[1].drop(timing).equals(full.frames()[1].drop(timing))
    counts = full.frames()[1].row(0, named=True)
    assert (counts["policy_cycles"], counts["policy_verified"], counts["policy_decodes"], counts["target_decode_steps"]) == (6, 4 * 7 + 2 * 15, 3, 6)
    assert lean.frames()[0].height == 0 and full.frames()[0].height == 4 + 4 + 3 + 4 + 2


def test_an_executor_without_the_cycle_table_returns_the_same_tokens_and_counts(tiny):
    """Guards against ``Executor(cycle_table=False)`` (what ``dflash-trt serve`` builds) changing what a call
    returns or what its execute rows count: the same inputs give the same tokens and the same counters as
    an executor keeping its cycle rows, and ``cycle_stats`` is empty."""
    results = []
    for cycle_table in (True, False):
        executor = Executor(tiny.ort, tiny.dims, 4, cycle_table=cycle_table)
        sessions = [executor.open_session() for _ in range(3)]
        outputs = [executor.execute([Input(s, [3 + s, 9, 4], max_new_tokens=12) for s in sessions])]
        outputs.append(executor.execute([Input(s, [executor.session(s).pending], max_new_tokens=9) for s in sessions]))
        tokens = outputs  # per execute, per input its new tokens
        counters = executor.execute_stats().select(name for name in COUNTERS if not name.endswith("_us"))  # timings aside
        results.append((tokens, counters, executor.cycle_stats().height))
        executor.close()
    (tokens, counters, rows), (lean_tokens, lean_counters, lean_rows) = results
    assert lean_tokens == tokens and lean_counters.equals(counters)
    assert counters["cycles"].sum() > 0 and rows > 0 and lean_rows == 0


def test_bounded_log_drops_whole_oldest_batches_from_both_tables():
    """Guards against a log that grows without bound in a long-running service, and against a bound
    that cuts tables inconsistently (cycle rows without their execute row, or the reverse)."""
    sizes = [(i * 7) % 4 for i in range(50)]  # 0..3 cycle rows per batch
    log = StatsLog(max_rows=8)
    _log_batches(log, sizes)
    cycles, executes = log.frames()
    assert cycles.height <= 8 and executes.height <= 8
    first = executes["batch_id"][0]
    assert executes["batch_id"].to_list() == list(range(first, 50))  # a suffix of whole batches
    assert cycles.height == sum(sizes[first:])
    assert set(cycles["batch_id"]) <= set(executes["batch_id"])
    assert log.dropped == {"cycles": sum(sizes[:first]), "executes": first}
    assert executes["target_decode_steps"].sum() == cycles.height  # counters and rows still agree
    unbounded = StatsLog(max_rows=None)
    _log_batches(unbounded, sizes)
    assert unbounded.frames()[0].height == sum(sizes) and unbounded.dropped == {"cycles": 0, "executes": 0}


def test_drained_parts_hold_every_row_once(tiny, tmp_path):
    """Guards against drain_stats losing or duplicating rows: parts drained along the way, read back
    through the analysis loader, hold exactly the rows an undrained log holds, and the log is empty
    after each drain."""
    executor = Executor(tiny.ort, max_sessions=2)
    s = executor.open_session()
    executor.execute([Input(s, [5, 6, 7, 8])])
    parts = []
    for part in range(3):
        for _ in range(2):
            executor.execute([Input(s, [executor.session(s).pending])])
        executor.drain_stats(tmp_path / f"part-{part}")
        parts.append(scan_run(tmp_path / f"part-{part}.parquet"))
        assert executor.cycle_stats().height == 0 and executor.execute_stats().height == 0
    cycles = pl.concat([p.cycles.collect() for p in parts])
    executes = pl.concat([p.executes.collect() for p in parts])
    assert executes["batch_id"].to_list() == list(range(7))
    assert cycles["cycle_id"].to_list() == list(range(cycles.height))
    assert cycles["emitted"].sum() == executes["cycles"].sum() + executes["accepted"].sum() + 1  # + the prompt's token
    executor.close()
