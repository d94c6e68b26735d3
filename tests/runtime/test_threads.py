"""The concurrency model: one call at a time per backend, refused (BusyError) rather than interleaved."""

from __future__ import annotations

import threading

import pytest

from dflash_trt.errors import BusyError
from dflash_trt.runtime.executor import Executor, Input
from executor_fixtures import RecordingBackend


TINY_ROWS = 8  # cache rows of the module's Tiny (conftest)


class GatedBackend(RecordingBackend):
    """Parks the next ``run`` inside the backend until released, so another thread can call in meanwhile."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.inside, self.release, self.armed = threading.Event(), threading.Event(), False

    def run(self, graph, feeds, first_row):
        if self.armed:
            self.armed = False
            self.inside.set()
            assert self.release.wait(60), "never released"
        return super().run(graph, feeds, first_row)


def snapshot(executor: Executor) -> list:
    return [executor.session(s) for s in executor.sessions()]


def test_calls_during_an_execute_are_refused_and_change_nothing(tiny, oracle):
    """Guards against two threads interleaving graph runs on one backend (its IO bindings and output
    buffers are shared: every session diverged, silently): while one thread is inside execute(),
    every session call from another thread — and from a second executor over the same backend —
    raises BusyError and changes nothing, and the running batch still produces the reference's tokens."""
    backend = GatedBackend(tiny.ort)
    executor, other = Executor(backend, tiny.dims, 4), Executor(backend, tiny.dims, 4)
    a, b, c = executor.open_session(), executor.open_session(), other.open_session()
    executor.execute([Input(b, [7, 8, 9])])
    assert len({executor.session(a).row, executor.session(b).row, other.session(c).row}) == 3  # rows are the backend's
    before, pending_b = snapshot(executor), executor.session(b).pending
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    result: dict = {}
    backend.armed = True
    worker = threading.Thread(target=lambda: result.update(out=executor.execute([Input(a, prompt)])), name="owner")
    worker.start()
    assert backend.inside.wait(60)
    refused = [
        lambda: executor.execute([Input(b, [pending_b])]),
        executor.open_session,
        lambda: executor.close_session(b),
        lambda: executor.clone(b, 1),
        lambda: executor.set_sampling(b, 0.5),
        lambda: executor.session(b),
        executor.sessions,
        executor.close,
        other.open_session,
        lambda: other.execute([Input(c, [1, 2])]),
    ]
    for call in refused:
        with pytest.raises(BusyError, match=r"busy in execute\(\) on thread 'owner'"):
            call()
    backend.release.set()
    worker.join(60)
    assert result["out"][0] == oracle.continuation(prompt)[: len(result["out"][0])]
    after = {view.id: view for view in snapshot(executor)}
    assert after[b] == before[1] and after[a].frontier >= len(prompt)
    assert executor.refused_calls() == {"execute": 1, "open_session": 1, "close_session": 1, "clone": 1,
                                        "set_sampling": 1, "session": 1, "sessions": 1, "close": 1}
    assert other.refused_calls() == {"open_session": 1, "execute": 1}
    assert executor.execute_stats().height == 2  # the refused execute left no row
    out = executor.execute([Input(b, [pending_b])])[0]  # b continues as if nothing happened
    assert out == oracle.continuation([7, 8, 9, pending_b])[: len(out)]
    executor.close()
    other.close()


def test_threads_hammering_one_executor_never_diverge(tiny, oracle):
    """Guards against silent corruption under real contention: three threads each decode their own
    session through one executor as fast as they can, retrying on BusyError; every token each gets
    must be the reference's."""
    executor = Executor(tiny.ort, max_sessions=3)
    prompts = [[5 + i, 17, 23 + i, 42] for i in range(3)]
    sessions = [executor.open_session() for _ in prompts]
    expected = [oracle.continuation(p) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    busy = [0] * len(prompts)
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def drive(i: int) -> None:
        try:
            start.wait()
            fed = list(prompts[i])
            while len(prompts[i]) + len(got[i]) < 24:
                try:
                    out = executor.execute([Input(sessions[i], fed)])[0]
                except BusyError:
                    busy[i] += 1
                    continue
                got[i] += out
                fed = [out[-1]]
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    for i in range(len(prompts)):
        assert got[i] == expected[i][: len(got[i])], f"session {i} diverged"
    assert executor.refused_calls().get("execute", 0) == sum(busy)
    executor.close()


def test_closed_executor_gives_rows_back(tiny):
    """Guards against rows leaking from the backend: closing an executor (or dropping it) frees its
    rows for the next executor over the same backend, and a closed executor refuses calls."""
    from dflash_trt.errors import SessionError

    first = Executor(tiny.ort, max_sessions=tiny.rows)
    for _ in range(tiny.rows):
        first.open_session()
    with pytest.raises(SessionError, match="in use"):
        Executor(tiny.ort, max_sessions=1).open_session()
    first.close()
    with pytest.raises(SessionError, match="closed"):
        first.open_session()
    dropped = Executor(tiny.ort, max_sessions=tiny.rows)
    for _ in range(tiny.rows):
        dropped.open_session()
    del dropped  # no close(): its rows come back when it is collected
    with Executor(tiny.ort, max_sessions=tiny.rows) as again:
        assert len({again.session(again.open_session()).row for _ in range(tiny.rows)}) == tiny.rows
