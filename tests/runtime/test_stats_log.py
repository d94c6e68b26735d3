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
