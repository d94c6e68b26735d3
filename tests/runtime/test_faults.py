"""Fault injection at every graph kind, before and after its cache writes: only the batch's sessions
are poisoned, nothing of the failed batch reaches the stats, everyone else continues exactly."""

from __future__ import annotations

import pytest

from dflash_trt.analysis.counters import cross_check
from dflash_trt.errors import PoisonedError
from dflash_trt.export import contract as c
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor, Input
from executor_fixtures import RecordingBackend, Tracker

KINDS = (c.TARGET_PREFILL, c.DRAFT_CONTEXT, c.DRAFT, c.TARGET_VERIFY, c.VERIFY_ARGMAX, c.VERIFY_SAMPLE)
SAMPLED = Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=5)


TINY_ROWS = 4  # cache rows of the module's Tiny (conftest)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", KINDS)
def test_fault_at_each_graph_kind_poisons_only_its_batch(tiny, oracle, kind, when):
    """Guards against a failure in any graph — before it ran, or after it wrote its cache rows —
    leaving a half-updated session usable, touching a session outside the batch, keeping the failed
    batch's rows in the stats, or leaking stale cache contents into a fresh session on a reused row."""
    executor = Executor(backend := RecordingBackend(tiny.ort), tiny.dims, 4)
    t = Tracker(executor, oracle)
    a, b, bystander = t.open(), t.open(), t.open()
    if kind == c.VERIFY_SAMPLE:
        t.set_sampling(b, SAMPLED)
    t.execute([(b, [11, 12, 13, 14, 15], None, True), (bystander, [21, 22, 23], None, True)])
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    backend.fail_on, backend.fail_after = (kind, backend.counts.get(kind, 0) + 1), when == "after"
    long_prompt = list(range(30, 50))  # 20 tokens > block 8: prefill, then a drain through draft_context
    with pytest.raises(PoisonedError, match=rf"sessions \[{a}, {b}\].*injected failure {'after' if when == 'after' else 'in'} {kind}"):
        executor.execute([*map(_input, [(a, long_prompt, None, True)] + t.decode_inputs([b]))])
    assert executor.session(a).poisoned and executor.session(b).poisoned and not executor.session(bystander).poisoned
    assert executor.cycle_stats().equals(cycles)  # none of the failed batch's rows
    assert executor.execute_stats().height == executes.height + 1 and not executor.execute_stats()["ok"][-1]
    for s in (a, b):
        t.forget(s)
        executor.close_session(s)
    t.execute(t.decode_inputs([bystander]))  # untouched: the reference's next tokens
    fresh = [t.open(), t.open()]  # on the failed sessions' rows: they must start clean
    t.execute([(fresh[0], long_prompt, None, True), (fresh[1], [11, 12, 13, 14, 15], None, True)] + t.decode_inputs([bystander]))
    t.execute(t.decode_inputs([*fresh, bystander]))
    check = cross_check(executor.cycle_stats().lazy(), executor.execute_stats().lazy()).collect()
    assert check["match"].all(), check
    executor.close()


def _input(item: tuple) -> Input:
    s, tokens, position, produce = item
    return Input(s, list(tokens), position=position, produce_output=produce)
