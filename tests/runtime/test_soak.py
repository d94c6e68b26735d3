"""Open / execute / clone / close churn with stats drained: memory stays flat, outputs stay exact.

CI runs a short churn and measures Python allocations (tracemalloc); ``--long`` runs 10,000 API
calls and measures the process RSS (``benchmarks/RESULTS.md`` has the figures).
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from dflash_trt.runtime.executor import Executor, Input
from executor_fixtures import Oracle

PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3]  # > block 8: a drain every round


TINY_ROWS = 4  # cache rows of the module's Tiny (conftest)


def churn(executor: Executor, expected: list[int], rounds: int) -> int:
    """``rounds`` of open → prompt → decode → clone → decode both → close both (9 API calls each);
    every output checked against ``expected``. Returns the API calls made."""
    for _ in range(rounds):
        s = executor.open_session()
        out = executor.execute([Input(s, PROMPT)])[0]
        out += executor.execute([Input(s, [out[-1]])])[0]
        copy = executor.clone(s, executor.session(s).frontier)
        outs = executor.execute([Input(s, [out[-1]]), Input(copy, [out[-1]])])
        assert outs[0] == outs[1] and out + outs[0] == expected[: len(out) + len(outs[0])]
        executor.close_session(copy)
        executor.close_session(s)
        executor.drain_stats()
    return 9 * rounds


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_churn_keeps_python_memory_flat(tiny):
    """Guards against per-call leaks (session table, rows, stats rows, pending batches, refusals):
    after warm-up, another 24 rounds of churn (216 calls) allocate no lasting Python memory."""
    expected = Oracle(tiny.target, tiny.dims.max_context).continuation(PROMPT)
    with Executor(tiny.ort, max_sessions=2) as executor:
        churn(executor, expected, 6)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            churn(executor, expected, 24)
            gc.collect()
            growth = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
        finally:
            tracemalloc.stop()
        assert growth < 64 * 1024, f"{growth} bytes kept after 216 calls"
        assert executor.sessions() == [] and executor.cycle_stats().height == 0


@pytest.mark.long
def test_ten_thousand_calls_keep_rss_flat(tiny):
    """Guards against leaks anywhere in the process (ONNX Runtime bindings, torch tensors, the
    allocator) over 10,000 API calls: RSS within 5 MB after warm-up."""
    expected = Oracle(tiny.target, tiny.dims.max_context).continuation(PROMPT)
    with Executor(tiny.ort, max_sessions=2) as executor:
        churn(executor, expected, 100)
        gc.collect()
        start = rss_bytes()
        calls = churn(executor, expected, 10_000 // 9 + 1)
        gc.collect()
        growth = rss_bytes() - start
    print(f"\n{calls} calls: RSS {start / 2**20:.1f} MiB -> {(start + growth) / 2**20:.1f} MiB ({growth / 2**20:+.2f} MiB)")
    assert abs(growth) <= 5 * 2**20
