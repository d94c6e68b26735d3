"""The device loop's Triton glue (runtime/kernels/loop_ops.py) leaves what its torch glue leaves.

The checks live in tests/loop_checks.py: on the CPU they run in two subprocesses under Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before triton is imported), on a GPU compiled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interpreted import results as interpreted_results

from dflash_trt.errors import InputError
from dflash_trt.runtime.device_loop import DeviceLoop

try:
    import triton  # noqa: F401

    TRITON = True
except ImportError:
    TRITON = False

gpu = pytest.mark.gpu
CHECKS = ("programs", "verdict", "executor")
INTERPRETED = """
import json, sys, traceback
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import loop_checks
results = {{}}
for name in {checks!r}:
    try:
        getattr(loop_checks, "check_" + name)("cpu")
        results[name] = "ok"
    except Exception:
        results[name] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results))
"""


# Two processes at once, about equal (the executor's check ~19 s of a core on a 2-core box, the others ~9).
PROCESSES = (("executor",), ("programs", "verdict"))


def interpreted_scripts() -> list[str]:
    """The interpreted checks' scripts (``PROCESSES``), none without Triton (conftest starts them at collection)."""
    tests = str(Path(__file__).parents[1])
    return [INTERPRETED.format(tests=tests, checks=checks) for checks in PROCESSES] if TRITON else []


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every check of loop_checks on CPU tensors, Triton interpreted, in two subprocesses (``PROCESSES``), started
    in the background as the run was collected (tests/interpreted.py)."""
    if not TRITON:
        pytest.skip("needs triton (it ships with the CUDA builds of torch)")
    return interpreted_results(__name__, interpreted_scripts())


def _passed(results: dict[str, str], name: str) -> None:
    assert results.get(name) == "ok", results.get(name, f"{name} did not run: {sorted(results)}")


def test_triton_glue_leaves_the_torch_glues_state(interpreted):
    """Bug: a glue kernel reads or writes the wrong slot, column or row (the draft position not moved to the
    cycle's start, a tap at the wrong pending row or written when the pending rows are full, the record's
    proposals shifted, a sampled row's position or seed off by one, a padded lane writing a live row): after
    a cycle at every verify length or a decode step, greedy and sampled, padded or not, one or two rounds, the
    records, int state, context pool and caches differ from the torch glue's."""
    _passed(interpreted, "programs")


def test_triton_glue_verdict_is_the_contracts(interpreted):
    """Bug: the glue's verdict stops one short when every proposal matches (no bonus token), accepts past the
    first mismatch, or reads proposals past the verify length: against ``export.sampling.verdict`` on two-token
    choices (every accepted count from 0 to k, k = 1, 3, 7, 15), with the record, state and context rows it writes;
    and the gathered state's rows, the graphs' feeds, start 16-byte aligned at any owner count (a misaligned feed
    makes Triton compile other variants of the graphs' kernels for some owner counts)."""
    _passed(interpreted, "verdict")


def test_triton_glue_keeps_every_requests_tokens(interpreted):
    """Bug: the Triton glue's verdict counts accepted proposals differently from ``export.sampling.verdict``
    (the first mismatch, all accepted, the bonus token), or its sampled rows choose at other positions: the
    default pair's requests (DFlash and plain decoding, greedy and sampled, more requests than sessions)
    return other tokens than with the torch glue."""
    _passed(interpreted, "executor")


def test_glue_choice_is_checked():
    """Bug: an unknown glue name is silently taken as one of the others (a typo measuring the wrong kernels)."""
    with pytest.raises(InputError, match="glue must be one of"):
        DeviceLoop(None, None, None, 1, graphs=False, glue="cuda")


def test_triton_glue_is_refused_where_it_cannot_run(monkeypatch):
    """Bug: ``loop_glue='triton'`` asked of a backend whose programs bind consecutive rows (no slots to gather by),
    or on a CPU without Triton's interpreter, fails deep inside a launch (a Triton pointer error, a missing
    attribute) instead of a typed error at construction naming the field, what it needs and what it got."""
    import loop_checks

    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.executor import Executor

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fast = loop_checks._backend("cpu")
    try:
        with pytest.raises(InputError, match=r"loop_glue='triton' runs Triton kernels: .*TRITON_INTERPRET=1\), got device cpu"):
            Executor(fast, loop_glue="triton")
        Executor(fast, loop_glue="torch").close()  # the same backend with the torch glue runs
    finally:
        fast.close()
    eager = TorchBackend(fast.target, fast.draft, fast.dims, 2, device="cpu", kernels="eager")
    try:
        assert not eager.row_indexed
        with pytest.raises(InputError, match="loop_glue='triton' needs a row-indexed backend .* got the torch backend"):
            Executor(eager, loop_glue="triton")
        with pytest.raises(InputError, match="loop_glue must be one of"):
            Executor(eager, loop_glue="cuda")
    finally:
        eager.close()


@gpu
@pytest.mark.parametrize("check", CHECKS)
def test_triton_glue_matches_the_torch_glue_on_cuda(check):
    """Bug: compiled for the GPU, a glue kernel differs from its interpreted self (a masked load's other value,
    an int64 offset truncated): the same checks as on the CPU, on CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import loop_checks

    getattr(loop_checks, f"check_{check}")("cuda")
