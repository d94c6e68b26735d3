"""Random sequences of executor API calls against a simple model of session state (hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from dflash_trt.analysis.counters import cross_check
from dflash_trt.errors import InputError, PoisonedError, SamplingError, SessionError
from dflash_trt.export import contract as c
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor, Input
from executor_fixtures import Oracle, RecordingBackend, Tiny, Tracker, single_thread

MAX_SESSIONS = 5
SAMPLINGS = st.builds(
    Sampling,
    temperature=st.sampled_from([0.0, 0.0, 0.7, 1.5]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.8]),
    seed=st.integers(0, 2**64 - 1),
)
BAD_SAMPLING = st.sampled_from(
    [
        dict(temperature=math.nan),
        dict(temperature=-0.5),
        dict(temperature=math.inf),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_k=-1),
        dict(seed=-3),
        dict(seed=2**64),
        dict(temperature=1e308),
        dict(temperature=1e-40),
        dict(temperature=0.5, top_p=1e-50),
        dict(temperature=True),
        dict(top_p=np.bool_(True)),
        dict(top_k=True),
        dict(top_k=2.0),
        dict(seed=True),
    ]
)
BAD_CONTAINERS = st.sampled_from([lambda t: dict.fromkeys(t), set, frozenset, lambda t: iter(t), lambda t: [bool(x) for x in t],
                                  lambda t: np.array(t, dtype=np.float32), lambda t: np.array([t]), str])
FAULT_KINDS = st.sampled_from([c.TARGET_PREFILL, c.DRAFT_CONTEXT, c.DRAFT, c.TARGET_VERIFY, c.VERIFY_ARGMAX, c.VERIFY_SAMPLE])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_thread()


class ExecutorMachine(RuleBasedStateMachine):
    """Valid calls must keep every output equal to the reference; invalid ones must raise and change nothing."""

    tiny: Tiny
    oracle: Oracle

    def __init__(self) -> None:
        super().__init__()
        self.backend = RecordingBackend(self.tiny.ort)
        self.executor = Executor(self.backend, self.tiny.dims, MAX_SESSIONS)
        self.drained: list[tuple[pl.DataFrame, pl.DataFrame]] = []
        self.t = Tracker(self.executor, self.oracle)
        self.vocab, self.max_context = self.tiny.dims.vocab_size, self.tiny.dims.max_context

    def teardown(self) -> None:
        self.executor.close()  # its rows go back to the shared backend

    # ------------------------------------------------------------ helpers

    def snapshot(self):
        return [self.executor.session(s) for s in self.executor.sessions()], {s: list(q) for s, q in self.t.seq.items()}

    def refused(self, error: type, call) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            call()
        assert self.snapshot() == before

    def pick(self, data, label: str = "session") -> int:
        return data.draw(st.sampled_from(sorted(self.t.seq)), label=label)

    def tokens(self, data, low: int, high: int) -> list[int]:
        return data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=low, max_size=high), label="tokens")

    def valid_input(self, data, s: int) -> tuple | None:
        """A valid (session, tokens, position, produce_output) for ``s``, or None if it is full."""
        frontier = self.t.frontier(s)
        kinds = ["replay", "append"] + (["decode"] * 3 if self.t.pending[s] and frontier + 1 <= self.max_context else [])
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "decode":
            return (s, [self.t.seq[s][-1]], None, True)
        position = frontier if kind == "append" else data.draw(st.integers(0, frontier), label="position")
        room = self.max_context - position
        if room < 1:
            return None
        if kind == "replay" and position < len(self.t.seq[s]) and data.draw(st.booleans(), label="same tokens"):
            tokens = self.t.seq[s][position : position + data.draw(st.integers(1, 4))]
        else:
            tokens = self.tokens(data, 1, min(room, 20))
        produce = data.draw(st.sampled_from([True, True, True, False]), label="produce_output")
        return (s, tokens, position, produce)

    def valid_batch(self, data) -> list[tuple]:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.t.seq)), min_size=1, max_size=len(self.t.seq), unique=True), label="owners")
        return [item for s in chosen if (item := self.valid_input(data, s)) is not None]

    # ------------------------------------------------------------ rules

    @initialize(data=st.data())
    def start(self, data) -> None:
        """Two sessions with prompts (one long enough to drain), so every example has state to break."""
        sessions = [self.t.open(), self.t.open()]
        lengths = [data.draw(st.integers(1, 8), label="short prompt"), data.draw(st.integers(9, 40), label="long prompt")]
        self.t.execute([(s, self.tokens(data, n, n), None, True) for s, n in zip(sessions, lengths)])

    @precondition(lambda self: any(self.t.pending.values()))
    @rule()
    def decode_all(self) -> None:
        """The serving loop's common call: every session with a pending token feeds it (the fast path)."""
        live = [s for s in self.t.seq if self.t.pending[s] and self.t.frontier(s) + 1 <= self.max_context]
        if live:
            self.t.execute(self.t.decode_inputs(live))

    @precondition(lambda self: len(self.t.seq) < MAX_SESSIONS)
    @rule()
    def open_session(self) -> None:
        self.t.open()

    @precondition(lambda self: len(self.t.seq) == MAX_SESSIONS)
    @rule()
    def open_session_when_full(self) -> None:
        self.refused(SessionError, self.executor.open_session)

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data())
    def close_session(self, data) -> None:
        self.t.close(self.pick(data))

    @rule(session=st.integers(-2, 50))
    def close_unknown(self, session) -> None:
        if session not in self.t.seq:
            self.refused(SessionError, lambda: self.executor.close_session(session))

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data())
    def clone(self, data) -> None:
        s = self.pick(data)
        upto = data.draw(st.integers(0, self.t.frontier(s)), label="upto")
        if len(self.t.seq) < MAX_SESSIONS:
            self.t.clone(s, upto)
        else:
            self.refused(SessionError, lambda: self.executor.clone(s, upto))

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data())
    def clone_past_frontier(self, data) -> None:
        s = self.pick(data)
        upto = self.t.frontier(s) + data.draw(st.integers(1, 5), label="past")
        self.refused((InputError, SessionError), lambda: self.executor.clone(s, upto))

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data(), sampling=SAMPLINGS)
    def set_sampling(self, data, sampling) -> None:
        self.t.set_sampling(self.pick(data), sampling)

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data(), bad=BAD_SAMPLING)
    def set_bad_sampling(self, data, bad) -> None:
        s = self.pick(data)
        self.refused(SamplingError, lambda: self.executor.set_sampling(s, **bad))

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data())
    def execute(self, data) -> None:
        batch = self.valid_batch(data)
        if batch:
            self.t.execute(batch)

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data(), flaw=st.sampled_from(["token", "position", "session", "size", "offset", "end", "poisoned-free"]))
    def execute_invalid(self, data, flaw) -> None:
        batch = [Input(s, list(tokens), position=position, produce_output=produce) for s, tokens, position, produce in self.valid_batch(data)]
        s = self.pick(data, "flawed session")
        # After s's own inputs (if any) the next one must continue where they end.
        mine = [i for i, item in enumerate(batch) if item.session == s]
        frontier = self._end(batch[mine[-1]]) if mine else self.t.frontier(s)
        bad = {
            "token": (Input(s, [1, self.vocab], position=frontier), InputError),
            "position": (Input(s, [1], position=frontier + 1), InputError),
            "session": (Input(max(self.t.seq) + 100, [1]), SessionError),
            "size": (Input(s, [1, 2], position=frontier, size=0), InputError),
            "offset": (Input(s, [1, 2], position=frontier, offset=3), InputError),
            "end": (Input(s, [1] * (self.max_context + 1 - frontier), position=frontier), InputError),
            "poisoned-free": (Input(s, [1], position=-1), InputError),
        }[flaw]
        batch.insert(data.draw(st.integers(mine[-1] + 1 if mine else 0, len(batch)), label="where"), bad[0])
        self.refused(bad[1], lambda: self.executor.execute(batch))

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data(), spell=BAD_CONTAINERS)
    def execute_bad_container(self, data, spell) -> None:
        """Tokens as a dict / set / iterator / bools / floats / 2-D array / text: refused, nothing changed."""
        s = self.pick(data)
        tokens = self.tokens(data, 1, 4)
        self.refused(InputError, lambda: self.executor.execute([Input(s, spell(tokens), position=self.t.frontier(s))]))

    @precondition(lambda self: self.t.seq)
    @rule(data=st.data(), kind=FAULT_KINDS, after=st.booleans())
    def execute_with_fault(self, data, kind, after) -> None:
        """A graph of the batch fails (before or after its cache writes): its sessions are poisoned and
        closed; every other session must go on exactly as the reference."""
        batch = self.valid_batch(data)
        if not batch:
            return
        self.backend.fail_on, self.backend.fail_after = (kind, self.backend.counts.get(kind, 0) + 1), after
        try:
            self.t.execute(batch)  # this batch may not run that graph kind: then it must just be right
        except PoisonedError:
            for s in {item[0] for item in batch}:
                assert self.executor.session(s).poisoned
                self.t.forget(s)
                self.executor.close_session(s)
        finally:
            self.backend.fail_on = None

    @rule()
    def drain_stats(self) -> None:
        self.drained.append(self.executor.drain_stats())
        assert self.executor.cycle_stats().height == 0 and self.executor.execute_stats().height == 0

    def _end(self, item: Input) -> int:
        start = self.t.frontier(item.session) if item.position is None else item.position
        return start + len(item.tokens)

    @invariant()
    def sessions_agree(self) -> None:
        assert self.executor.sessions() == sorted(self.t.seq)
        assert not any(self.executor.session(s).poisoned for s in self.t.seq)
        self.t.check_state()

    @invariant()
    def stats_agree(self) -> None:
        """Counters and cycle rows tell the same story over every row ever logged (drained or not);
        batch ids are contiguous (refusals leave no row)."""
        frames = [*self.drained, (self.executor.cycle_stats(), self.executor.execute_stats())]
        cycles, executes = pl.concat([f[0] for f in frames]), pl.concat([f[1] for f in frames])
        assert executes["batch_id"].to_list() == list(range(executes.height))
        assert cross_check(cycles.lazy(), executes.lazy()).collect()["match"].all()


def test_random_api_call_sequences(exported_pair, request):
    """Guards against any API call sequence that corrupts state: invalid calls (bad tokens, token
    containers, positions, sizes, offsets, sessions, sampling values and types, clones, a full pool)
    must raise their typed error and change nothing; injected graph faults must poison exactly their
    batch; valid calls (prompts, decodes, replays, appends without output, clones, sampling changes,
    closes, stats drains) must keep every output equal to the reference target-only continuation and
    the stats consistent. ``--long`` runs ``--long-examples`` sequences (10,000) instead of 25."""
    long = request.config.getoption("--long")
    examples = request.config.getoption("--long-examples") if long else 25
    tiny = Tiny(exported_pair)
    ExecutorMachine.tiny, ExecutorMachine.oracle = tiny, Oracle(tiny.target, tiny.dims.max_context)
    try:
        run_state_machine_as_test(
            ExecutorMachine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=10,
                deadline=None,
                database=None,
                derandomize=not long,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        tiny.close()
