"""The executor: the session API over a Backend, running batched DFlash cycles.

API (docs/design.md §5):

- ``open_session(speculate=None) -> id``, ``close_session(id)``,
  ``clone(id, upto) -> id``, ``set_sampling(id, temperature, top_k, top_p,
  seed)``, ``session(id)``.
- ``execute(batch) -> outputs``: a batch is a list of ``Input`` (or dicts)
  ``{session, tokens, offset, size, position, produce_output,
  max_new_tokens, stop}``; the output of input i is the list of new tokens
  it produced ([] without produce_output): the target's prediction after a
  prompt/replay input, then the tokens of one speculative cycle (emitted
  d_1..d_a, y_a) — or, with ``max_new_tokens``, of as many cycles as fit
  (``max_cycles`` per call), cut at the room and the first stop token.
  ``execute_outputs(batch, on_tokens, should_yield, admit, stream_interval, on_streamed)``
  streams them (every launch, or on a delivery tick; ``on_streamed`` closes each
  burst), may end early, and takes
  new prompts into the running call (``Admission``: a session opened for each,
  prefilled between two rounds).
- ``preferred_batch_tokens``: the largest prefill chunk.

One execute():

1. ``validate_batch`` checks EVERY input (nothing is mutated on refusal:
   SessionError / PoisonedError / InputError naming the field).
2. Rewinds (a first input that starts before its session's frontier).
3. Target step (``target_prefill``, chunked) for every input that is not
   one token to decode; taps are committed to the context pool on device,
   draining all but B rows through ``draft_context`` (sessions that do not
   speculate keep no taps).
4. The loop (``runtime.device_loop`` on the device, ``runtime.launches`` on the
   host): every session whose last input produced output decodes, owners
   packed by consecutive rows, ≤ max_owners per launch. A drafting session
   whose block fits runs cycles: ``draft_n`` → ``target_verify_n`` →
   ``verify_argmax_n``/``verify_sample_n`` → bookkeeping, on the device,
   one CUDA graph per cycle where the backend allows it; per round the
   speculation policy (``runtime.policy``, ``policy=``) may run a plain decode
   step for them instead, whose tap the device keeps as pending context.
   Others (speculation off, or no room for a block) run plain decode steps
   (``target_decode_n``, then ``sample`` or the argmax). Inputs that are exactly the pending token
   skip step 3 (the pending-decode fast path; each input qualifies on its
   own, whatever the rest of the batch holds). The host reads each verdict
   from pinned memory while the next cycle runs; tokens past a stop or the
   room are discarded and the session rewound to its last returned token.
5. Pending tokens are set for the next call.

A failure after step 1 poisons every session of the batch (PoisonedError
chained to the cause); those are refused until closed. Other sessions' rows
are never bound by this batch's graphs, so their outputs do not change. The
failed batch's cycle rows and counts never reach the stats (``StatsLog``).

Threads: one call at a time per backend; a concurrent call is refused with
``BusyError`` (``runtime.ownership``).

Taps never leave the device: verify taps are copied device-to-device into the
context pool, prefill taps are drained or copied the same way
(``hidden_bytes_d2h`` stays 0). The host reads only tokens and verdicts.
"""

from __future__ import annotations

import logging
import secrets
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from operator import attrgetter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import numpy as np
import polars as pl
import torch

from dflash_trt.checks import is_int
from dflash_trt.errors import BusyError, DFlashError, EngineError, InputError, PoisonedError, SamplingError, SessionError
from dflash_trt.export import contract as c
from dflash_trt.export.sampling import GREEDY, Sampling
from dflash_trt.export.torch_dtypes import TORCH_DTYPES
from dflash_trt.runtime.backends.base import Backend
from dflash_trt.runtime.cycles import (
    block_fits, chunks, cycle_modes, make_verdicts, pack_rows, plan_context, prefill_batches, rounds_kept, sampling_rows, trim_context,
)
from dflash_trt.runtime.device_loop import ACCEPTED_COLUMN, CYCLE, DECODE, NEXT_COLUMN, PROPOSALS_COLUMN, DeviceLoop, Launch, check_glue, padded
from dflash_trt.runtime.finish import CONTEXT
from dflash_trt.runtime.launches import Group, Lane, LoopShape, run_launches
from dflash_trt.runtime.limits import DEFAULT_MAX_CYCLES, MAX_LAG, MAX_LAUNCH_ROUNDS
from dflash_trt.runtime.policy import DRAIN, POLICIES, PROBE, SWITCH, Choice, make_policy
from dflash_trt.runtime.prefill import PREFILL_QUANTUM, PrefillLaunch, PrefillPrograms, Prompt
from dflash_trt.runtime.sessions import ContextPool, Input, Limits, Output, Session, SessionTable, SessionView, Step, int_in, validate_batch
from dflash_trt.runtime.stats import DEFAULT_MAX_ROWS, ExecuteRows, StatsLog, stats_paths, write_parquet
from dflash_trt.runtime.timing import make_clock

__all__ = ["Admission", "Executor", "Input", "Output"]

_ROW = attrgetter("session.row")  # a lane's cache row (the order of a group's lanes)
PENDING = object()  # a prediction on the device, not read yet (``Executor._target_work``)


def _pending(lane: Lane) -> tuple[int, bool]:
    """The most pending context rows the lane can hold once its unread launches are read, and whether one of
    them is a cycle. Exact while none is: a cycle consumes every pending row and leaves those of its accepted
    proposals and of the token after them, at most its verify length + 1 (``Flight.width`` per round), so
    past one the count is bounded by that plus the decode rounds launched behind it."""
    s, cycled = lane.session, False
    pending = s.frontier - s.draft_position
    for f in lane.flight:
        if f.kind == CYCLE:
            pending, cycled = f.width // f.rounds, True
        else:
            pending += f.rounds
    return pending, cycled


def _pick(values: list, members: list[int] | None) -> list:
    """``values`` (one per lane of a launch) of the lanes ``members``; None: every lane's, as they are."""
    return values if members is None else [values[i] for i in members]


def _round_members(live: list[int], rounds: int) -> Iterator[tuple[int, list[int] | None]]:
    """Each round ``r`` of a launch read at once, with the lanes that keep its verdict (``live[i]``: how many of
    the rounds lane i keeps, from the first): their indices, or None where every lane keeps every round."""
    everyone = live.count(rounds) == len(live)
    for r in range(rounds):
        yield r, None if everyone else [i for i, until in enumerate(live) if until > r]


def _runs(lane: Lane, kind: str, choice: Choice, proposals: int, shape: LoopShape) -> bool:
    """Set the lane's next launch (``Executor._set_kind``'s fields, made once per round) and say whether it may launch."""
    lane.kind, lane.choice, lane.proposals, lane.shape = kind, choice, proposals, shape
    return lane.may_launch()


@dataclass(eq=False)
class _Joining:
    """One batched prefill of an execute: planned (``steps``, ``prompts``, ``width``), then launched
    (``launched``, its clock marks), then read by ``Executor._join`` into ``lanes`` (the execute's lanes
    by step index; its steps without a lane have none)."""

    steps: list[Step]
    prompts: list[Prompt]
    width: int
    lanes: dict[int, Lane] = field(default_factory=dict)
    launched: PrefillLaunch | None = None
    after: int = 0  # the loop's launches made before it (``Executor._read`` joins it before reading a later one)
    t0: object = None
    t1: object = None


@dataclass(eq=False)
class _CallState:
    """One execute's inputs as they grow: its steps (the batch's, then the admitted ones': ``_admitted_steps``),
    every lane, the sessions admissions opened and the errors of refused ones, by input index, and the
    call's rounds as last seen."""

    steps: list[Step]
    lanes: list[Lane]
    opened: dict[int, int] = field(default_factory=dict)  # input index -> the session an admission opened
    refused: dict[int, DFlashError] = field(default_factory=dict)
    rounds: int = 0

    @property
    def inputs(self) -> int:
        """The inputs numbered so far: the batch's and every admission's, refused ones too."""
        return len(self.steps) + len(self.refused)


class Admission(NamedTuple):
    """A request joining a running execute (``Executor.execute_outputs``' ``admit``): the prompt of a new
    session, its limits (``Input``'s ``max_new_tokens`` and ``stop``), its sampling and whether it drafts
    (None: the executor's default). The executor opens the session; the output names it."""

    tokens: list[int]
    max_new_tokens: int | None = None
    stop: Sequence[int] = ()
    sampling: Sampling = GREEDY
    speculate: bool | None = None


LOG = logging.getLogger(__name__)


def _target_tokens(steps: list[Step]) -> int:
    """The target tokens an execute's inputs fed (its stats row): every input's but the pending-decode ones'."""
    return sum(len(step.tokens) for step in steps if not step.fast)


class Executor:
    """Sessions and batched DFlash cycles over one backend (see the module docstring).

    Threads: one call at a time per backend (``runtime.ownership``). A call
    made while another is running (another thread, or another executor over
    the same backend) raises ``BusyError`` and changes nothing; stats reads
    (``cycle_stats``, ``execute_stats``, ``write_stats``, ``refused_calls``)
    are safe from any thread.
    """

    def __init__(
        self,
        backend: Backend,
        dims: c.Dims | None = None,
        max_sessions: int | None = None,
        stats_rows: int | None = DEFAULT_MAX_ROWS,
        speculate: bool = True,
        max_cycles: int = DEFAULT_MAX_CYCLES,
        lag: int = 1,
        cycle_graphs: bool = True,
        stats_age_s: float | None = None,
        policy: str | object = "always",
        launch_rounds: int = 1,
        loop_glue: str = "auto",
        cycle_table: bool = True,
    ) -> None:
        """``dims`` and ``max_sessions`` default to the backend's (its contract dims and pool rows);
        ``stats_rows`` bounds each stats table in memory (None: unbounded; see ``drain_stats``),
        ``stats_age_s`` the age of the rows kept (None: no age bound); ``cycle_table`` False keeps no
        cycle rows (``cycle_stats`` stays empty; the execute rows and their counters are kept): where
        nobody reads them (a server), each owner's row per round is host work for nothing.

        ``speculate``: sessions draft by default (False: plain target decoding,
        the autoregressive baseline through the same runtime; per session:
        ``open_session(speculate=...)``). ``max_cycles``: cycles (or decode
        steps) one execute may run per owner group for inputs with
        ``max_new_tokens``. ``lag``: launches a lane keeps queued beyond the one
        being read, 0 to ``MAX_LAG`` (0: read each before the next; True / False: 1 / 0); the outputs are
        the same whatever it is (``runtime.launches``).
        ``cycle_graphs``: capture each cycle as one CUDA graph where the
        backend allows it (``Backend.capturable``). ``policy`` (``runtime.policy``):
        ``adaptive`` picks a cycle or a plain decode step per round for drafting
        sessions from measured costs and acceptance; ``always`` cycles whenever
        a block fits (or any object with ``runtime.policy.AdaptivePolicy``'s
        ``choose`` / ``observe``). Greedy output is the same under any policy.
        ``launch_rounds``: the most rounds (cycles or decode steps) one launch runs back to back on the
        device, read at once; outputs and tokens per call are the same whatever it is. Under load on a GPU
        the host's work per launch is what bounds throughput, and 4 pays there (``serve``'s default on CUDA:
        benchmarks/RESULTS.md, "Four rounds per launch by default on CUDA"); with one session the rounds a
        request's end discards cost device time (gpu_e2e: 2.23x against 2.50x at 1), and a joining request
        waits for a longer launch.
        ``loop_glue``: ``DeviceLoop(glue=)`` — the device loop's own kernels around the graphs, ``"auto"``
        (Triton on CUDA with a row-indexed backend), ``"triton"`` or ``"torch"``; the same outputs whatever it is.
        """
        dims = dims if dims is not None else backend.dims
        self.ownership = backend.ownership()
        rows = self.ownership.rows.rows
        max_sessions = max_sessions if max_sessions is not None else rows
        if not is_int(max_sessions) or not 1 <= max_sessions <= rows:
            msg = f"max_sessions must be an int in [1, {rows}] (the backend's cache rows), got {max_sessions!r}"
            raise InputError(msg)
        self.backend, self.dims = backend, dims
        self.device = backend.device
        self.table = SessionTable(max_sessions, self.ownership.rows)
        # Rows are the backend's: a session's pending taps live at its row of a pool as tall as the backend's.
        self.limits = Limits(dims.vocab_size, dims.max_context, dims.block_size)
        # A row-indexed backend's pools end with a scratch row (device_loop: padded lanes): the context pool too.
        self.context = ContextPool(rows + backend.row_indexed, dims.block_size, dims.tap_width, TORCH_DTYPES[dims.dtype], self.device)
        self.clock = make_clock(backend)
        stream = getattr(backend, "stream", None)
        # Every call runs on the backend's stream (``BackendStream.current``): host values in and out.
        self._on_stream = stream.current if stream is not None and self.device.type == "cuda" else nullcontext
        if stats_rows is not None and (not isinstance(stats_rows, int) or isinstance(stats_rows, bool) or stats_rows < 1):
            raise InputError(f"stats_rows must be an int >= 1 or None (unbounded), got {stats_rows!r}")
        if stats_age_s is not None and (isinstance(stats_age_s, bool) or not isinstance(stats_age_s, (int, float)) or not stats_age_s > 0):
            raise InputError(f"stats_age_s must be a number of seconds > 0 or None (no age bound), got {stats_age_s!r}")
        self.log = StatsLog(stats_rows, stats_age_s, bool(cycle_table))
        if not is_int(max_cycles) or max_cycles < 1:
            raise InputError(f"max_cycles must be an int >= 1, got {max_cycles!r}")
        if not (is_int(lag) or isinstance(lag, bool)) or not 0 <= lag <= MAX_LAG:
            raise InputError(f"lag must be an int in [0, {MAX_LAG}] (or a bool), got {lag!r}")
        self.speculate, self.max_cycles, self.lag = bool(speculate), max_cycles, int(lag)
        if isinstance(policy, str) and policy not in POLICIES:
            raise InputError(f"policy must be one of {POLICIES} (or a policy object), got {policy!r}")
        self.policy = make_policy(policy, dims.verify_proposals) if isinstance(policy, str) else policy
        if not is_int(launch_rounds) or not 1 <= launch_rounds <= MAX_LAUNCH_ROUNDS:
            raise InputError(f"launch_rounds must be an int in [1, {MAX_LAUNCH_ROUNDS}], got {launch_rounds!r}")
        check_glue(loop_glue, backend, "loop_glue")
        self.loop = DeviceLoop(backend, dims, self.context, rows, cycle_graphs, launch_rounds, self.lag, loop_glue)
        self.prefill = PrefillPrograms(self.loop, self.context, max_sessions, self.speculate) if self.loop.row_indexed else None
        self._prepare_programs()
        self.closed = False
        self._on_tokens: Callable | None = None
        self._on_streamed: Callable[[], None] | None = None
        self._stream_interval = self._next_tick = 0.0  # ``execute_outputs``' delivery tick, and when it is next due
        self._should_yield: Callable[[int], bool] | None = None
        self._joining: list[_Joining] = []  # prefills launched, their tokens not read yet (``_join``)
        self._launches = 0  # the loop's launches so far (``_launch``: each one's sequence number)
        # A launch's cost to the policy (``_read``): the serving thread's time since the previous read ended (planning,
        # admissions, launches, the wait) less the other launches' calls made meanwhile, plus its own call.
        self._read_mark = 0.0  # perf_counter when the previous read ended (or the run's launches began)
        self._launched_since = 0.0  # seconds of the launch calls made since then
        self._admit: Callable[[], Sequence[Admission]] | None = None
        self._call_state: _CallState | None = None  # the running execute's inputs and lanes (``_run``)
        self._shapes: dict[tuple[str, int, int], LoopShape] = {}  # _set_kind's, by (kind, proposals, max_cycles)
        self._ending: list[tuple[Session, int, int]] = []  # (session, draft position, rows): ``_assign``'s drains, due
        # The longest verify length behind which a decode step's tap fits (k + 1 rows + 1 <= B; 0: none): a
        # decode round's drains and ``SWITCH`` cycles (``_decode_round``).
        self._switch = max((k for k in dims.verify_proposals or (dims.proposals,) if k + 2 <= dims.block_size), default=0)
        self._sampled_missing = self._missing_sampled_graphs()  # a greedy-only engine set's: sampling refused
        # Rows go back to the backend even if the executor is dropped without close().
        self._release = weakref.finalize(self, self.table.rows.give_all, self.table.held)

    def _prepare_programs(self) -> None:
        """Capture every program a row-indexed loop can launch, now (start-up), so none is captured or
        compiled while serving; logged, since it takes seconds on a large model."""
        sampled = (False, True) if c.graph_name(c.VERIFY_SAMPLE, 1) in self.backend.graph_names else (False,)
        keys = self.loop.programs(sampled)
        if not keys or not self.loop.graphs:
            return
        started = time.perf_counter()
        LOG.info("capturing %d decode programs (cycle and decode steps, %s owners)", len(keys), sorted({k.owners for k in keys}))
        self.loop.prepare(keys)
        shapes = self.prefill.prepare()
        LOG.info("captured %d decode programs and %d prefill programs in %.1f s", len(keys), shapes, time.perf_counter() - started)

    @contextmanager
    def _call(self, name: str, count_refusals: bool = True) -> Iterator[None]:
        """One API call: holds the backend's call guard and runs on the backend's stream; typed errors raised here
        count as refused."""
        try:
            with self.ownership.guard.hold(name), self._on_stream():
                if self.closed:
                    raise SessionError(f"{name}: this executor is closed")
                yield
        except BusyError:
            self.log.refuse(name)
            raise
        except DFlashError:
            if count_refusals:
                self.log.refuse(name)
            raise

    def close(self) -> None:
        """Close every session and give their rows back to the backend; later calls raise SessionError."""
        if self.closed:
            return
        with self._call("close"):
            self.table.close_all()
            self.loop.close()  # waits for the stream: the prefill buffers are free after it
            if self.prefill is not None:
                self.prefill.close()
            self.closed = True
            self._release.detach()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions

    @property
    def max_sessions(self) -> int:
        return self.table.max_sessions

    @property
    def preferred_batch_tokens(self) -> int:
        """Tokens one target_prefill call takes at most (longer inputs are chunked)."""
        return self.dims.max_chunk

    def open_session(self, speculate: bool | None = None) -> int:
        """A fresh session (empty caches, greedy sampling); SessionError when max_sessions are open.

        ``speculate`` (default: the executor's): draft, or decode with the target alone.
        """
        with self._call("open_session"):
            self.table.room("open_session")
            return self.table.open(self.speculate if speculate is None else bool(speculate)).id

    def close_session(self, session: int) -> None:
        """Release a session and its row (poisoned ones too); SessionError if unknown."""
        with self._call("close_session"):
            self.table.close(session)

    def session(self, session: int) -> SessionView:
        with self._call("session"):
            s = self.table.get(session, "session", allow_poisoned=True)
            return SessionView(s.id, s.row, s.frontier, s.draft_position, s.pending, s.sampling, s.poisoned, s.speculate)

    def sessions(self) -> list[int]:
        with self._call("sessions"):
            return sorted(self.table.sessions)

    def set_sampling(self, session: int, temperature: float | Sampling = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> None:
        """Temperature / top-k / top-p and the seed of the sampling noise (random when None), or one
        ``Sampling`` value in place of the four; checked by ``Sampling.checked`` against the vocabulary."""
        with self._call("set_sampling"):
            s = self.table.get(session, "set_sampling.session")
            if isinstance(temperature, Sampling):
                temperature, top_k, top_p, seed = temperature.temperature, temperature.top_k, temperature.top_p, temperature.seed
            seed = secrets.randbits(64) if seed is None else seed
            sampling = Sampling.checked(temperature, top_k, top_p, seed, self.dims.vocab_size)
            if sampling.temperature > 0:
                self._require_sampled_graphs(sampling.temperature)
            s.sampling = sampling

    def _missing_sampled_graphs(self) -> list[str]:
        """The sampled verifiers (every owner count and verify length) the backend's graphs lack: none but on a
        greedy-only engine set. Asked once, at construction: the backend's graphs are fixed, and the question
        costs max_owners x lengths lookups in a list of every graph name, rebuilt per lookup (0.2 s at 64 owners
        on a 2-core x86 host), far too much for each sampled request's admission on the serving thread."""
        have = set(self.backend.graph_names)
        n_range = range(1, self.dims.max_owners + 1)
        wanted = [c.verify_graph(self.dims, c.VERIFY_SAMPLE, n, k) for k in self.dims.verify_proposals for n in n_range]  # every length
        return [g for g in wanted if g not in have]

    def _require_sampled_graphs(self, temperature: float) -> None:
        """A greedy-only engine set (no verify_sample_n) cannot serve sampled sessions: refuse up front."""
        missing = self._sampled_missing
        if missing:
            msg = (
                f"set_sampling.temperature: this {self.backend.name} backend serves greedy sessions only "
                f"(temperature 0): its artifacts lack {missing}, needed for sampled verification; got temperature {temperature}"
            )
            raise SamplingError(msg)

    def clone(self, session: int, upto: int) -> int:
        """A new session holding positions 0..upto-1 of ``session`` (caches copied row to row).

        A copy that fails leaves nothing behind (the new session is closed, the
        source was only read): EngineError naming the cause.
        """
        with self._call("clone"):
            source = self.table.get(session, "clone.session")
            upto = int_in("clone.upto", upto, 0, source.frontier, f"(session {session}'s frontier)")
            self.table.room("clone")
            copy = self.table.open(source.speculate)
            try:
                self._copy_session(source, copy, upto)
            except BaseException as error:
                self.table.close(copy.id)  # the source was only read
                if not isinstance(error, Exception) or isinstance(error, DFlashError):
                    raise
                msg = f"clone({session}, {upto}): copying the caches failed, nothing changed: {type(error).__name__}: {error}"
                raise EngineError(msg) from error
            return copy.id

    def _copy_session(self, source: Session, copy: Session, upto: int) -> None:
        draft, keep = trim_context(source.frontier, source.draft_position, upto)
        if upto:
            self.backend.copy_rows("target", source.row, copy.row, upto)
        if draft:
            self.backend.copy_rows("draft", source.row, copy.row, draft)
        self.context.copy(source.row, copy.row, keep)  # device to device (pending taps trimmed to upto)
        self.log.count("hidden_rows_d2d", keep, self.tap_row_bytes)
        copy.frontier, copy.draft_position = upto, draft
        copy.pending = source.pending if upto == source.frontier else None
        copy.sampling = source.sampling

    @property
    def tap_row_bytes(self) -> int:
        return self.dims.tap_width * self.context.taps.element_size()

    # ------------------------------------------------------------------ execute

    def execute(self, batch: Sequence[Input | dict]) -> list[list[int]]:
        """Run one batch (see the module docstring). Returns per input its new tokens."""
        return [output.tokens for output in self.execute_outputs(batch)]

    def execute_outputs(
        self, batch: Sequence[Input | dict], on_tokens: Callable | None = None, should_yield: Callable[[int], bool] | None = None,
        admit: Callable[[], Sequence[Admission]] | None = None, stream_interval: float = 0.0, on_streamed: Callable[[], None] | None = None,
    ) -> list[Output]:
        """``execute``, returning per input its new tokens and why they ended (``Output.finish``).

        ``on_tokens(index, tokens, finish)``, called on this thread while the call runs, receives input
        ``index``'s tokens as soon as they are final (after each launch's verdict is read; ``finish``:
        STOP / LENGTH once they end it, else None — CONTEXT is known only in the outputs), so a server
        can stream them before the call returns; the outputs still hold every token. The callback
        must not call into the executor (it is busy). With ``stream_interval`` > 0 (seconds) only an
        input's first tokens (a prompt's: not a pending token's continuation) and those that end it go
        out at once; the others are held and every input's go out together at the first read
        ``stream_interval`` after the last such delivery (a server's delivery tick: one callback per
        input per tick, not per launch); what is held when the call ends is in the outputs only.
        ``on_streamed()`` is called on this thread after each burst of ``on_tokens`` calls (a read's, the
        prefilled prompts'), before the call waits on the device again: a server hands them on then, one
        message per burst, the first tokens without waiting for the first cycle.

        ``should_yield(finished)``, asked before each launch after the first round with how many of
        the call's inputs have ended (STOP / LENGTH) so far, ends the call early when True (a server
        with a request waiting for the gap between calls): the launches in flight are read and
        returned; the sessions go on at the next call, with the same tokens.

        ``admit()``, asked after ``should_yield`` (a server: requests that arrived while the call runs),
        returns ``Admission``s joining the running call, so they need not wait for its end: each opens a
        session and is checked alone (a refused one opens none and runs nothing: its output's ``error``
        says why), then they are prefilled together between two rounds and decode with the call's lanes
        from the next round. Their outputs follow the batch's, in the order admitted, each naming its
        session (``Output.session``); ``on_tokens`` numbers them so. If the call fails, the sessions it
        opened are closed (the others poisoned, as ever). The call still ends within ``max_cycles``
        rounds: an admitted lane runs the rounds left; ``admit`` is not asked once fewer than two are
        left, nor once every lane of the call has ended (its end is a launch away). Where prompts are
        prefilled one by one (a backend that binds row ranges) an admitted prompt waits for the device:
        ``admits_cheaply`` says which it is.
        """
        if not isinstance(stream_interval, (int, float)) or isinstance(stream_interval, bool) or not stream_interval >= 0:
            raise InputError(f"stream_interval must be a number of seconds >= 0, got {stream_interval!r}")
        with self._call("execute", count_refusals=False):
            self._on_tokens, self._should_yield, self._admit, self._on_streamed = on_tokens, should_yield, admit, on_streamed
            self._stream_interval, self._next_tick = float(stream_interval), time.perf_counter() + stream_interval
            try:
                return self._execute(batch)
            finally:
                self._on_tokens = self._should_yield = self._admit = self._on_streamed = None
                self._call_state = None

    @property
    def admits_cheaply(self) -> bool:
        """Admitted prompts are prefilled together on the device with no host wait (``execute_outputs``'
        ``admit``): a row-indexed backend (the torch fast path). Elsewhere each waits for the device."""
        return self.loop.row_indexed

    def _execute(self, batch: Sequence[Input | dict]) -> list[Output]:
        try:
            steps = validate_batch(self.table, batch, self.limits)
        except DFlashError:
            self.log.refuse("execute")  # no execute row, batch_id unchanged: nothing ran
            raise
        self.log.begin()
        try:
            outputs = self._run(steps)  # appends the admitted inputs' steps to ``steps``
        except BaseException as error:
            self._poison(steps)
            self._close_opened()  # admitted sessions the caller never learned of
            self.log.fail(len(steps), _target_tokens(steps))  # the batch's cycle rows and counts are dropped
            if not isinstance(error, Exception):
                raise
            ids = sorted({s.session.id for s in steps} - set(self._call_state.opened.values() if self._call_state else ()))
            msg = f"execute failed after mutating sessions {ids}; they are poisoned (close them): {type(error).__name__}: {error}"
            raise PoisonedError(msg) from error
        fast = all(s.fast for s in steps)
        self.log.counters["pending_decode_batches"] += fast
        self.log.commit(len(steps), _target_tokens(steps), fast)
        return outputs

    def _close_opened(self) -> None:
        call = self._call_state
        for session in call.opened.values() if call is not None else ():
            self.table.close(session)

    def _poison(self, steps: list[Step]) -> None:
        for step in steps:
            step.session.poisoned = True
            step.session.pending = None

    def _run(self, steps: list[Step]) -> list[Output]:
        for step in steps:
            if step.rewind:
                self._rewind(step.session, step.start)
        lanes, joining = self._lanes_of(steps)
        call = self._call_state = _CallState(steps, lanes)
        try:
            self._decode([lane for lane in lanes if lane.decodes], lanes, joining)
            self._join()
        finally:
            self._drop_joining()  # after a failure: prefills launched and never read
        made: list[Output | None] = [None] * call.inputs
        for lane in lanes:  # the batch's and the admitted inputs'
            if lane.session.frontier > lane.keep_until:  # tokens past a stop / the room were discarded
                self._rewind(lane.session, lane.keep_until)
            made[lane.step.index] = Output(lane.tokens, lane.finish or self._context_full(lane.session))
        for index, error in call.refused.items():
            made[index] = Output([], error=error)
        for index, session in call.opened.items():
            made[index] = replace(made[index] or Output([]), session=session)
        outputs = [Output([]) if output is None else output for output in made]  # no lane: no output asked
        for step in steps:
            if step.last:
                # The last emitted token sits AT the new frontier, not yet fed.
                step.session.pending = outputs[step.index].tokens[-1] if outputs[step.index].tokens else None
        return outputs

    def _lanes_of(self, steps: list[Step]) -> tuple[list[Lane], list[_Joining]]:
        """The steps' target work (``_target_work``) and their lanes, each handed its batched prefill's; the
        predictions of the prompts run alone go to ``on_tokens`` (the batched ones' at ``_join``)."""
        predictions, joining = self._target_work(steps)
        lanes = [lane for step in steps if (lane := self._lane(step, predictions)) is not None]
        self._stream(lanes)
        by_step = {lane.step.index: lane for lane in lanes}
        for batch in joining:
            batch.lanes = by_step
        return lanes, joining

    def _context_full(self, s: Session) -> str | None:
        """CONTEXT when the session's next token would sit at max_context (its pending token cannot be fed)."""
        return CONTEXT if s.frontier + 1 > self.dims.max_context else None

    def _lane(self, step: Step, predictions: dict[int, int | None]) -> Lane | None:
        """The step's lane, if it produces tokens (``Lane.decodes``: whether the loop runs it further);
        ``predictions``: the target's token after each prompt/replay step (``_target_work``)."""
        s = step.session
        if step.fast or step.decode:
            self.log.counters["pending_decode_owners"] += step.fast
            s.pending = None
            return Lane(step, s, step.tokens[0], step.start + 1, continues=True)
        prediction = predictions[step.index]
        if prediction is None:
            return None
        if prediction is PENDING:  # a batched prefill's: on the device as the row's anchor, read by ``_join``
            lane = Lane(step, s, 0, s.frontier)
            lane.first_pending = True
        else:
            lane = Lane(step, s, prediction, s.frontier)
            lane.add([prediction])
        drafts = s.speculate and block_fits(s.frontier, self.dims.block_size, self.dims.max_context)
        decodes = step.room is not None and s.frontier + 1 <= self.dims.max_context
        # A pending first token may still be a stop token: the lane launches, and what follows it is discarded
        # (as after any finishing read); a room of one it fills whatever it is.
        filled = lane.finished or (lane.first_pending and step.room is not None and step.room <= 1)
        if not step.last or filled or not (drafts or decodes):
            self.log.counters["target_decode_steps"] += step.last
            lane.decodes = False
        return lane

    def _rewind(self, s: Session, position: int) -> None:
        """Rewind to ``position``: target KV past it is stale (masked by length, overwritten later).

        Pending taps are the first ``frontier - draft_position`` rows of the
        context pool row, so trimming them is moving the two positions.
        """
        s.draft_position, _ = trim_context(s.frontier, s.draft_position, position)
        s.frontier, s.pending = position, None

    # ------------------------------------------------------------------ target

    def _target_work(self, steps: list[Step]) -> tuple[dict[int, object], list[_Joining]]:
        """Run every prompt/replay step's tokens through the target: the prediction after each (None
        without produce_output; ``PENDING`` for a batched prefill's, read later), by step index, and the
        batched prefills, planned (their sessions' positions moved) but not launched (``_decode`` launches
        them behind the staging of the loop's state, ``_join`` reads their tokens).

        On a row-indexed backend the prompts of fresh contexts (one step of their session in this
        batch, one chunk long, no pending taps) are prefilled together, a few launches per batch
        (``cycles.prefill_batches``); every other step runs alone, in batch order (``_target_step``).
        """
        targets = [step for step in steps if not (step.fast or step.decode)]
        sessions = Counter(step.session.id for step in targets)
        together = [step for step in targets if self._batchable(step, sessions)]
        predictions: dict[int, object] = {}
        joining: list[_Joining] = []
        if together:  # row-indexed: self.prefill exists
            lengths = [len(step.tokens) for step in together]
            for members, width in prefill_batches(lengths, self.prefill.budget, PREFILL_QUANTUM, self.prefill.launch_tokens, self.prefill.most):
                joining.append(self._plan_prefill([together[m] for m in members], width))
                predictions |= {step.index: PENDING if step.produce_output else None for step in joining[-1].steps}
        batched = {step.index for step in together}
        for step in targets:
            if step.index not in batched:
                predictions[step.index] = self._target_step(step)
        return predictions, joining

    def _batchable(self, step: Step, sessions: Counter) -> bool:
        s = step.session
        return (
            self.loop.row_indexed
            and sessions[s.id] == 1
            and len(step.tokens) <= self.dims.max_chunk
            and (not s.speculate or s.pending_rows == 0)
        )

    def _plan_prefill(self, steps: list[Step], width: int) -> _Joining:
        """One prefill program for ``steps`` (padded to ``width`` tokens; ``runtime.prefill``), planned: their
        prompts (taps drained and kept, the token chosen on the device) and their sessions' positions after it."""
        prompts = []
        for step in steps:
            s = step.session
            # A fresh context (nothing pending): all but the last B rows drained, those B kept pending.
            plan = plan_context(0, len(step.tokens), self.dims.block_size) if s.speculate else None
            drain, keep = (plan.drained, plan.keep[1] - plan.keep[0]) if plan is not None else (0, 0)
            prompts.append(Prompt(step.tokens, s.frontier, s.row, s.draft_position, drain, keep, s.sampling, step.end))
        for step, p in zip(steps, prompts):
            self._commit_prompt(step.session, p)
        return _Joining(steps, prompts, width)

    def _launch_prefills(self, joining: Sequence[_Joining]) -> None:
        """Launch the planned prefills (no host sync on CUDA); ``_join`` reads them (all at once: the host
        slots of those still unread come first)."""
        offset = sum(len(batch.steps) for batch in self._joining)
        for batch in joining:
            batch.after = self._launches
            batch.t0 = self.clock.mark()
            batch.launched = self.prefill.launch(batch.prompts, batch.width, offset)
            batch.t1 = self.clock.mark()
            offset += len(batch.steps)
            self._joining.append(batch)

    def _drop_joining(self) -> None:
        """Forget unread prefills (a failed run: the loop waited for the stream), releasing their events."""
        joining, self._joining = self._joining, []
        for batch in joining:
            if batch.launched.done is not None:
                batch.launched.done.close()
            self.clock.release(batch.t0, batch.t1)

    def _join(self) -> None:
        """Host sync: the launched prefills' tokens -> their lanes (the first token each), the stats and
        ``on_tokens``. Before any verdict of those lanes is read (``_read``), and at the end of the run."""
        joining, self._joining = self._joining, []
        for batch in joining:
            tokens = self.prefill.read(batch.launched)
            self.log.counters["target_preamble_forwards"] += 1
            self.log.counters["target_preamble_calls"] += len(batch.steps)
            if any(p.drain for p in batch.prompts):
                self.log.counters["draft_forwards"] += 1
            ms = self.clock.elapsed_ms(batch.t0, batch.t1) / len(batch.steps)  # one launch: its device time shared evenly
            rows = [step for step in batch.steps if step.produce_output]  # a target row each, in batch order
            if rows:
                self.log.target_rows([step.session for step in rows], [step.end - 1 for step in rows], ms)
            self.clock.release(batch.t0, batch.t1)
            lanes = []
            for step, token in zip(batch.steps, tokens):
                lane = batch.lanes.get(step.index)
                if lane is None:
                    continue
                lane.first_pending, lane.anchor = False, token
                lane.add([token])
                if lane.finished and lane.decodes:  # its first token ended it: what it launched is discarded
                    self.log.counters["target_decode_steps"] += step.last
                lanes.append(lane)
            self._stream(lanes)

    def _commit_prompt(self, s: Session, p: Prompt) -> None:
        """A prefilled prompt's positions: ``p.drain`` rows in the draft cache, ``p.keep`` pending."""
        length = len(p.tokens)
        s.pending = None
        if s.speculate:
            self.log.counters["warmed_context_tokens"] += p.drain
            self.log.count("hidden_rows_d2d", p.keep, self.tap_row_bytes)
            s.draft_position += p.drain
            s.drained_rows += p.drain
            s.frontier += length
        else:
            s.frontier = s.draft_position = s.frontier + length  # no drafting: taps are not kept

    def _target_step(self, step: Step) -> int | None:
        """Run the input's tokens through target_prefill (chunked); the prediction at ``end`` if asked."""
        s = step.session
        assert step.start == s.frontier, (step.start, s.frontier)
        s.pending = None
        t0 = self.clock.mark()
        logits = None
        for lo, hi in chunks(len(step.tokens), self.dims.max_chunk):
            feeds = {
                c.TOKENS: torch.tensor([step.tokens[lo:hi]], dtype=torch.int64, device=self.device),
                c.START: torch.tensor([s.frontier], dtype=torch.int64, device=self.device),
            }
            out = self.backend.run(c.TARGET_PREFILL, feeds, s.row)
            self.log.counters["target_preamble_forwards"] += 1
            logits = out[c.LOGITS]  # [1, V]
            if s.speculate:
                self._commit_taps(s, out[c.TAPS][0])  # before the next chunk reuses the output
            else:
                s.frontier = s.draft_position = s.frontier + hi - lo  # no drafting: taps are not kept
        self.log.counters["target_preamble_calls"] += 1
        if not step.produce_output:
            self.clock.release(t0)
            return None
        prediction = self._choose(s, logits, step.end)
        t1 = self.clock.mark()
        self.log.target_row(s, step.end - 1, self.clock.elapsed_ms(t0, t1))
        self.clock.release(t0, t1)
        return prediction

    def _choose(self, s: Session, logits: torch.Tensor, position: int) -> int:
        """The target's token AT ``position`` from logits [1, V]: the backend's ``sample`` graph (the verifiers' choice)."""
        feeds = self._sampling_feeds([s.sampling], [position]) | {c.LOGITS: logits}
        token = self.backend.run(c.SAMPLE, feeds, 0)[c.TOKEN]
        return int(token[0].item())  # host sync: one token id

    def _commit_taps(self, s: Session, taps: torch.Tensor) -> None:
        """taps [R, W] of positions frontier.. : pending context, draining all but B rows (on device)."""
        new, pending = taps.shape[0], s.pending_rows
        plan = plan_context(pending, new, self.dims.block_size)
        if plan.drained:
            rows = torch.cat([self.context.rows(s.row, pending), taps])  # [pending + R, W], device copy
            self._drain(s, rows[: plan.drained], s.draft_position)  # in max_chunk runs
            kept = rows[plan.keep[0] : plan.keep[1]]
            self.context.store(s.row, kept)  # device copy
            s.draft_position += plan.drained
            s.drained_rows += plan.drained
            self.log.count("hidden_rows_d2d", pending + new + kept.shape[0], self.tap_row_bytes)
        else:
            self.context.taps[s.row, pending : pending + new].copy_(taps)  # device copy
            self.log.count("hidden_rows_d2d", new, self.tap_row_bytes)
        s.frontier += new

    def _drain(self, s: Session, rows: torch.Tensor, start: int) -> None:
        """rows [n, W] of positions start.. into the session's draft cache: ``draft_context``, max_chunk rows a run."""
        for lo, hi in chunks(rows.shape[0], self.dims.max_chunk):
            feeds = {c.TAPS: rows[None, lo:hi], c.START: torch.tensor([start + lo], dtype=torch.int64, device=self.device)}
            self.backend.run(c.DRAFT_CONTEXT, feeds, s.row)
            self.log.counters["draft_forwards"] += 1
        self.log.counters["warmed_context_tokens"] += rows.shape[0]

    # ------------------------------------------------------------------ the loop

    def _decode(self, lanes: list[Lane], every: list[Lane], joining: Sequence[_Joining] = ()) -> None:
        """Every lane's cycles (drafting sessions with a block's room) or plain decode steps, on the device;
        ``every``: the call's lanes, those done at their prompts' predictions included (``should_yield``);
        ``joining``: the batched prefills, launched after the loop's state is staged (they write their rows'
        anchors) and before the first round, whose verdicts are read after their tokens (``_join``)."""
        if not lanes:
            if joining:
                with self.loop.on_stream():
                    self._launch_prefills(joining)
            return
        self._ending.clear()  # none left by a call that failed before draining them
        for lane in lanes:
            self._assign(lane)
        sessions = [lane.session for lane in lanes]
        rows, anchors, samplings = [s.row for s in sessions], [lane.anchor for lane in lanes], [s.sampling for s in sessions]
        frontiers, drafts = [s.frontier for s in sessions], [s.draft_position for s in sessions]
        self._policed = [lane for lane in lanes if lane.policed]  # admitted ones join (``_admit_lanes``)
        self._plain = [lane for lane in lanes if not lane.session.speculate]  # ... and stopped ones (``_stop_drafting``)
        self._sampling = any(sampling.temperature > 0 for sampling in samplings)  # else no group samples (_pack)
        admit = self._admit_lanes if self._admit is not None else None
        with self.loop.running():
            self.loop.stage(rows, anchors, frontiers, drafts, samplings)
            self._launch_prefills(joining)  # stream order: after the staging (their anchors win), before the rounds
            self._drain_ending()  # after the prefills that wrote those rows, before the launches that write them again
            self._read_mark, self._launched_since = time.perf_counter(), 0.0
            run_launches(lanes, self._pack, self._launch, self._read, self.lag, self._plan_round, self._yield_check(every), admit)

    def _admit_lanes(self, candidates: Sequence[Lane]) -> list[Lane]:
        """``run_launches``' admit: the caller's admissions, checked (``_admitted_steps``), their target work
        planned, their rows staged and their prefills launched (stream order: ahead of the round they join);
        returns their lanes that decode."""
        call = self._call_state
        if candidates:  # the call's rounds so far, read off a lane launching now (lanes of one launch go together)
            call.rounds = candidates[0].launched + candidates[0].spent
        # None once the rounds left are too few, or when no lane decodes on (the call is ending: a request
        # waits for its end, ~a launch, and starts the next call with the whole max_cycles).
        if call.rounds + 2 > self.max_cycles or all(lane.finish is not None for lane in candidates):
            return []
        steps = self._admitted_steps(self._admit())
        if not steps:
            return []
        lanes, joining = self._lanes_of(steps)
        call.lanes += lanes
        decoding = [lane for lane in lanes if lane.decodes]
        for lane in decoding:
            self._assign(lane)
            lane.spent = call.rounds
        sessions = [lane.session for lane in decoding]
        if sessions:
            self._policed += [lane for lane in decoding if lane.policed]
            self._plain += [lane for lane in decoding if not lane.session.speculate]
            self._sampling = self._sampling or any(s.sampling.temperature > 0 for s in sessions)
            anchors, samplings = [lane.anchor for lane in decoding], [s.sampling for s in sessions]
            self.loop.stage_more([s.row for s in sessions], anchors, [s.frontier for s in sessions], [s.draft_position for s in sessions], samplings)
        self._launch_prefills(joining)  # after the staging (their anchors win)
        self._drain_ending()  # after the prefills that wrote those rows
        return decoding

    def _admitted_steps(self, admitted: Sequence[Admission]) -> list[Step]:
        """The admissions that may join, as steps numbered after the call's inputs, each in a session opened
        for it; a refused one is recorded (``_CallState.refused``) and leaves nothing behind."""
        call, steps = self._call_state, []
        for admission in admitted:
            index = call.inputs + len(steps)
            try:
                step = self._admission(admission, index)
            except DFlashError as error:
                self.log.refuse("execute.admit")
                call.refused[index] = error
                continue
            call.opened[index] = step.session.id
            steps.append(step)
        call.steps += steps
        return steps

    def _admission(self, admission: Admission, index: int) -> Step:
        """One admission's step, in a session opened for it with its sampling; InputError / SessionError /
        SamplingError naming ``admit[index]``'s field when it cannot join (the refusals ``validate_batch``,
        ``open_session`` and ``set_sampling`` make), with no session left open."""
        where = f"admit[{index}]"
        if not isinstance(admission, Admission):
            raise InputError(f"{where} must be an Admission, got {type(admission).__name__}")
        sampling = admission.sampling
        if not isinstance(sampling, Sampling):
            raise SamplingError(f"{where}.sampling must be a Sampling, got {type(sampling).__name__}")
        try:
            sampling = sampling.check(self.dims.vocab_size)
            if sampling.temperature > 0:
                self._require_sampled_graphs(sampling.temperature)
            self.table.room("session")
            s = self.table.open(self.speculate if admission.speculate is None else bool(admission.speculate))
        except DFlashError as error:
            raise type(error)(f"{where}: {error}", param=error.param, code=error.code) from error
        try:
            (step,) = validate_batch(self.table, [Input(s.id, admission.tokens, max_new_tokens=admission.max_new_tokens, stop=admission.stop)], self.limits)
        except DFlashError as error:
            self.table.close(s.id)
            raise type(error)(f"{where}: {error}", param=error.param, code=error.code) from error
        s.sampling, step.index = sampling, index
        return step

    def _yield_check(self, every: list[Lane]) -> Callable[[], bool] | None:
        """``run_launches``' stop: the caller's ``should_yield`` with the count of lanes ended so far."""
        should_yield = self._should_yield
        if should_yield is None:
            return None
        return lambda: should_yield(len(every) - [lane.finish for lane in every].count(None))  # lanes ended so far

    def _assign(self, lane: Lane) -> None:
        """The lane's kind for this execute: a drafting session with a block's room is ``policed`` (the
        policy picks a cycle or a decode step per round: ``_plan_round``); others run decode steps.

        A drafting session without a block's room decodes on to the context's end (fewer than B positions
        are left) as a policed lane's decode steps do, each tap kept on the device as one more pending
        context row. Where its pending rows and the positions left exceed B, the pending rows are drained
        first, through the dynamic draft (``_drain_ending``, in stream order before its first launch), so
        no step finds them full; once drained they never fill again. Its draft context stays whole: a
        rewind to where a block fits drafts from it as from any other."""
        s = lane.session
        lane.policed = s.speculate and block_fits(s.frontier, self.dims.block_size, self.dims.max_context)
        if s.speculate and not lane.policed:
            self._take_pending(s)  # staged next: the device's steps write from pending row 0
        self._set_kind(lane, CYCLE if lane.policed else DECODE, None)

    def _take_pending(self, s: Session) -> bool:
        """``_assign``'s drain of a drafting session at the context's end, where its pending rows and the
        positions left exceed B: due (``_ending``), the session's positions moved as after it. Whether it is due."""
        if s.pending_rows + self.dims.max_context - s.frontier <= self.dims.block_size:
            return False
        self._ending.append((s, s.draft_position, s.pending_rows))
        s.drained_rows += s.pending_rows
        s.draft_position = s.frontier
        return True

    def _end(self, lane: Lane) -> None:
        """A policed lane whose block no longer fits, its launches read, decodes on to the context's end within
        this execute (``_assign``'s rule): its pending rows drained now where due, its draft position on the
        device moved to match."""
        lane.policed = False
        if lane in self._policed:
            self._policed.remove(lane)
        s = lane.session
        if self._take_pending(s):
            self._drain_ending()
            self.loop.move_draft(s.row, s.draft_position)
        self._set_kind(lane, DECODE, None)

    def _drain_ending(self) -> None:
        """The pending context rows ``_assign`` took off sessions at the context's end, through the dynamic
        draft at their positions, on the loop's stream: after the prefills that wrote them, before a decode
        step writes those rows again. Row-indexed backends: one ragged program for them all (prefill's
        ``draft_context_many``: any rows, no graph captured per row, no host sync); others: ``_drain`` each."""
        ending, self._ending = self._ending, []
        if not ending:
            return
        counts = [count for _, _, count in ending]
        if self.loop.row_indexed:
            columns = [[s.row for s, _, _ in ending], [start for _, start, _ in ending], counts]
            rows, starts, lengths = torch.tensor(columns, dtype=torch.int64, device=self.device)  # one copy to the device
            self.backend.draft_context_many(self.context.taps.index_select(0, rows), starts, lengths, rows)  # [n, B, W]
            self.log.counters["draft_forwards"] += 1
            self.log.counters["warmed_context_tokens"] += sum(counts)
        else:
            for s, start, count in ending:
                self._drain(s, self.context.rows(s.row, count), start)  # read by the graph's input copy, in stream order
        self.log.count("hidden_rows_d2d", sum(counts), self.tap_row_bytes)

    def _set_kind(self, lane: Lane, kind: str, choice: Choice | None) -> None:
        """The lane's next launch: ``kind``, a cycle verifying the choice's length (P without one)."""
        lane.kind, lane.choice = kind, choice
        lane.proposals, lane.shape = self._shape(kind, choice)

    def _shape(self, kind: str, choice: Choice | None) -> tuple[int, LoopShape]:
        """A launch of ``kind`` for ``choice``: its verify length and ``LoopShape`` (a handful of shapes, made once)."""
        proposals = (choice.proposals if choice is not None and choice.proposals else self.dims.proposals) if kind == CYCLE else 0
        key = (kind, proposals, self.max_cycles)  # max_cycles: an attribute callers may change between calls
        if (shape := self._shapes.get(key)) is None:
            B, L, cycles = self.dims.block_size, self.dims.max_context, self.max_cycles
            shape = self._shapes[key] = LoopShape(proposals + 1, B, L, cycles) if kind == CYCLE else LoopShape(1, 1, L, cycles)
        return proposals, shape

    def _plan_round(self, lanes: list[Lane]) -> list[Lane]:
        """One round: the policy's choice for the policed lanes, then per lane what its state allows
        (``runtime.launches.run_launches``'s ``choose``: the lanes returned may launch, ``Lane.may_launch``).
        The choice is made at the (padded) count of the execute's policed lanes still decoding, not of
        this round's: lanes that fall apart into small groups (a drain, a deferral) are then steered
        back to one kind, and one group; the round's lanes that decode whatever the choice count too.

        A decode choice: ``_decode_round``."""
        B, L = self.dims.block_size, self.dims.max_context
        policed = []
        for lane in lanes:
            if lane.policed:
                if lane.flight or block_fits(lane.session.frontier, B, L):
                    policed.append(lane)
                else:
                    self._end(lane)  # a decode lane from here on: among ``ready`` below, if it may launch
        if not policed:
            return [lane for lane in lanes if lane.may_launch()]
        ready = [lane for lane in lanes if not lane.policed and lane.may_launch()]
        # Lanes that decode whatever the choice (drafting stopped, no block's room, plain sessions) share a
        # decode round's launch: the round's count includes them.
        going, most = len(policed) + len(ready), self.dims.max_owners
        asked: dict[int, tuple[LoopShape, bool]] = {}  # id(lane) -> (its shape then, may_launch): asked once per lane
        # The count lies in [this round's, the execute's]: needed only when those two fall in different buckets.
        if going < len(self._policed) and padded(min(going, most), most) < padded(min(len(self._policed), most), most):
            count, kept = 0, []
            for lane in self._policed:
                if lane.finish is None:
                    asked[id(lane)] = (lane.shape, may := lane.may_launch())
                    count += may or bool(lane.flight)
                elif lane.flight:
                    count += 1
                else:
                    continue  # finished, nothing in flight: it never counts again (dropped, so a long execute's rounds do not walk its past lanes)
                kept.append(lane)
            self._policed = kept
            going = max(going, count)
        choice = self.policy.choose(padded(min(going, most), most))
        if self._plain:  # the execute's plain lanes decode beside this round: it measures neither option (``Choice.measured``)
            self._plain = [lane for lane in self._plain if lane.finish is None]
            if self._plain:
                choice = replace(choice, measured=False)
        if choice.kind == DECODE:
            decoding = self._decode_round(policed, choice, asked)
            if choice.why == PROBE and (missed := getattr(self.policy, "missed", None)) and not any(lane.kind == DECODE for lane in decoding):
                missed(choice)  # its lanes could not switch this round (cycles in flight): the probe is due again next round
            return ready + decoding
        proposals, shape = self._shape(CYCLE, choice)
        for lane in policed:
            lane.kind, lane.choice, lane.proposals, lane.shape = CYCLE, choice, proposals, shape  # _set_kind, made once
            if self._may_launch(lane, asked):
                ready.append(lane)
            elif lane.flight:  # offered again once read (its block may fit then; where not, ``_end``)
                lane.deferred = True
        return ready

    @staticmethod
    def _may_launch(lane: Lane, asked: dict[int, tuple[LoopShape, bool]]) -> bool:
        """``lane.may_launch()``, or ``_plan_round``'s count's answer while the lane keeps the shape it was asked
        under (nothing else moved since)."""
        answer = asked.get(id(lane))
        return answer[1] if answer is not None and answer[0] is lane.shape else lane.may_launch()

    def _decode_round(self, policed: list[Lane], choice: Choice, asked: dict[int, tuple[LoopShape, bool]]) -> list[Lane]:
        """The policed lanes of a decode round that launch (``_plan_round``; ``asked``: its may_launch answers).

        A lane whose pending context rows are full (B) must cycle (the cycle drains them: ``DRAIN``, charged
        to the decode round). When such a drain can launch, the whole round drains: every lane that can
        cycle does, in one launch, where a drain apart beside the others' decode step would add a launch
        each time a lane fills (lanes fill at different rounds); from then on their drains fall due
        together; a drain verifies at most the longest length that leaves its lane's next round room to
        decode (below). A lane no cycle fits (the context's end) decodes as before. Otherwise a lane with a
        cycle in flight decodes when even that cycle's longest verdict leaves a row for its step's tap
        (``_pending``: a cycle verifying k leaves at most k + 1 rows). Behind a longer one it may be full
        once that cycle is read, so it cycles once more at the longest verify length that leaves its next
        round room to decode (``SWITCH``, charged to cycle rounds of that length: a round of work where
        waiting for the read left the device idle), or, with no such length or no room for a block, waits
        for that read (deferred: it rejoins the others' decode steps in a later round); the others decode."""
        B, switch = self.dims.block_size, self._switch
        # Drains verify at most that length too: the round after one decodes at once.
        drain = replace(choice, kind=CYCLE, why=DRAIN, proposals=min(choice.proposals or self.dims.proposals, switch or B))
        cycle_proposals, cycle_shape = self._shape(CYCLE, drain)
        proposals, shape = self._shape(DECODE, choice)
        switching = replace(choice, kind=CYCLE, why=SWITCH, round=CYCLE, proposals=switch)
        switch_shape = self._shape(CYCLE, switching)[1] if switch else None
        rest, unknown, full = [], [], []  # room for a step's tap / full, or not, once its cycle is read / full
        for lane in policed:
            pending, cycled = _pending(lane)
            (rest if pending < B else unknown if cycled else full).append(lane)
        ready, draining = [], False
        # Cycling loses by estimate, or the draft is hopeless (beside plain lanes too): the full lanes stop drafting instead of draining.
        if full and ((choice.stop and choice.measured) or choice.hopeless):
            for lane in full:
                self._stop_drafting(lane)
                if lane.may_launch():
                    ready.append(lane)
            full = []
        for lane in full:  # the full lanes first: whether one of them drains decides the round
            if _runs(lane, CYCLE, drain, cycle_proposals, cycle_shape):
                ready.append(lane)
                draining = True
            elif lane.flight:  # offered again once read (its drain may fit then; where no block does, ``_end``)
                lane.deferred = True
        for lane in unknown:
            if (draining and _runs(lane, CYCLE, drain, cycle_proposals, cycle_shape)) or (
                switch and _runs(lane, CYCLE, switching, switch, switch_shape)
            ):
                ready.append(lane)
            else:
                lane.deferred = True
        for lane in rest:
            if draining and _runs(lane, CYCLE, drain, cycle_proposals, cycle_shape):
                ready.append(lane)
                continue
            lane.kind, lane.choice, lane.proposals, lane.shape = DECODE, choice, proposals, shape  # _set_kind, made once
            if self._may_launch(lane, asked):
                ready.append(lane)
        return ready

    def _stop_drafting(self, lane: Lane) -> None:
        """The lane's session drafts no more (``Choice.stop``): it decodes as a ``speculate=False`` session
        does from here on, its pending taps dropped (nothing will read them; on the device its pending
        count stays full, so its steps keep those rows unchanged), so no drain cycle ever falls due again.
        Its tokens are the same (only which program computes a token changes)."""
        s = lane.session
        s.speculate, s.draft_position = False, s.frontier  # an unread decode step's read moves both (``_read_decodes``)
        lane.policed = False
        self._set_kind(lane, DECODE, None)
        self._plain.append(lane)
        self.log.counters["drafting_stopped"] += 1

    def _rounds(self, lane: Lane, shared: bool = False) -> int:
        """The rounds the lane's next launch runs (``Lane.most_rounds``; ``shared``: in a launch that runs
        them anyway); a drafting lane's decode steps only while each keeps its tap on the device (pending
        rows below B)."""
        most = self.loop.most_rounds
        if most == 1:
            return 1
        rounds = lane.most_rounds(most, shared)
        if rounds > 1 and lane.kind == DECODE and lane.session.speculate and _pending(lane)[0] + rounds > self.dims.block_size:
            return 1
        return rounds

    def _pack(self, lanes: list[Lane]) -> list[Group]:
        """One launch's groups: per kind, verify length and rounds (each lane's set: ``_rounds``), ≤ max_owners
        lanes each, at consecutive rows unless the loop is row-indexed."""
        groups, kinds = [], {}
        for lane in lanes:  # one pass: the lanes by (kind, verify length, rounds), in their order
            lane.rounds = self._rounds(lane)
            kinds.setdefault((lane.kind, lane.proposals, lane.rounds), []).append(lane)
        if self.loop.most_rounds > 1:
            self._share_rounds(kinds)
        for kind, proposals, rounds in sorted(kinds, key=lambda key: (key[0] != CYCLE, -key[1], -key[2])):
            members = sorted(kinds[kind, proposals, rounds], key=_ROW)
            if self.loop.row_indexed:
                runs = [members[i : i + self.dims.max_owners] for i in range(0, len(members), self.dims.max_owners)]
            else:
                runs = [[members[m] for m in run.members] for run in pack_rows([lane.session.row for lane in members], self.dims.max_owners)]
            for run in runs:
                sampled = self._sampling and any(lane.session.sampling.temperature > 0 for lane in run)
                groups.append(Group(kind, sampled, run, proposals, rounds))
        return groups

    def _share_rounds(self, kinds: dict[tuple[str, int, int], list[Lane]]) -> None:
        """Lanes held to one round by their room alone join their kind's launch of ``most_rounds`` (``_pack``'s
        ``kinds``, changed in place). Apart, they would be a launch and a read more per round wherever requests
        end at different rounds, which under load is every round, and the host's plan, launch and read are
        per launch; a round a lane's room cannot use costs only device work (its tokens are discarded, as a
        read-ahead launch's are). The cache's end and ``max_cycles`` still hold each lane to what fits."""
        most = self.loop.most_rounds
        for kind, proposals, _ in [key for key in kinds if key[2] == 1 and (key[0], key[1], most) in kinds]:
            joined = kinds[kind, proposals, most]
            held = []
            for lane in kinds[kind, proposals, 1]:
                if self._rounds(lane, shared=True) == most:
                    lane.rounds = most
                    joined.append(lane)
                else:
                    held.append(lane)
            if held:
                kinds[kind, proposals, 1] = held
            else:
                del kinds[kind, proposals, 1]

    def _launch(self, group: Group) -> tuple[Launch, float, int]:
        """The group's program, launched; with the host seconds the launch call took (part of its cost)
        and its sequence number."""
        started, self._launches = time.perf_counter(), self._launches + 1
        counters = self.log.counters
        counters["loop_launches"] += 1
        counters["loop_rounds"] += group.rounds
        launch = self.loop.launch(group.kind, group.sampled, group.rows, group.proposals, group.rounds)
        launch_s = time.perf_counter() - started
        self._launched_since += launch_s
        return launch, launch_s, self._launches - 1

    def _read(self, group: Group, launched: tuple[Launch, float, int]) -> None:
        """Host sync (the launch's event): apply its verdict to the sessions, lanes and stats; hand
        the lanes' new tokens to ``on_tokens``. The launch's wall cost (its call, and the serving thread's
        time since the previous read less the other calls: the rounds' planning, admissions, the wait, this
        work) and the tokens it yielded go to the policy, charged to the round that chose it
        (``runtime.policy``: why wall time, why per round), and a cycle's acceptances to its
        acceptance by draft position."""
        launch, launch_s, sequence = launched
        # Prefills launched before this program: their tokens come first (its lanes' first tokens; the wait is
        # the prefill's, not charged to this launch). One launched after it (an admission) is not waited for:
        # it runs behind this program on the stream, and its lanes are in later launches only.
        if self._joining and sequence >= self._joining[0].after:
            joined = time.perf_counter()
            self._join()
            self._read_mark += time.perf_counter() - joined  # a prefill's wait is not this launch's cost
        records, device_ms = self.loop.read(launch)  # [rounds, owners, P+2]
        self.log.counters["loop_device_us"] += round(device_ms * 1000.0)
        rounds = len(records)
        read = self._read_cycles if group.kind == CYCLE else self._read_decodes
        tokens, lanes = read(group, records, device_ms / rounds)
        self._stream(group.lanes)
        choice = next((lane.flight[0].choice for lane in group.lanes if lane.flight[0].choice is not None), None)
        now = time.perf_counter()
        if choice is not None and choice.measured:  # per round: the policy compares rounds of either kind, whatever a launch runs
            seconds = launch_s + (now - self._read_mark - self._launched_since)
            self.policy.observe(choice.round, choice.owners, seconds / rounds, tokens / rounds, lanes / rounds, choice.proposals, group.kind)
        self._read_mark, self._launched_since = now, 0.0

    def _stream(self, lanes: Sequence[Lane]) -> None:
        """The lanes' new tokens to ``on_tokens``: all of them, or on a delivery tick (``execute_outputs``'
        ``stream_interval``) the first and the last of an input at once and every lane's held ones at the tick."""
        on_tokens = self._on_tokens
        if on_tokens is None:
            return
        due = True
        if self._stream_interval > 0:
            now = time.perf_counter()
            due = now >= self._next_tick
            if due:  # every lane of the call hands over what it holds, not only those just read
                self._next_tick = now + self._stream_interval
                lanes = lanes if self._call_state is None else self._call_state.lanes  # None: the call's first lanes
        handed = False
        for lane in lanes:
            tokens, sent = lane.tokens, lane.streamed
            if len(tokens) > sent and (due or lane.finish is not None or not (sent or lane.continues)):
                on_tokens(lane.step.index, tokens[sent:], lane.finish)
                lane.streamed, handed = len(tokens), True
        if handed and self._on_streamed is not None:
            self._on_streamed()

    def _read_cycles(self, group: Group, records: np.ndarray, device_ms: float) -> tuple[int, int]:
        """The launch's rounds of cycles applied (records [R, owners, P+2]; ``device_ms`` per round); returns the
        tokens they yielded (a + 1 per owner and round not finished before it) and those owner-rounds' count.

        Each lane takes its rounds' tokens at once (``Lane.add``: room and stop tokens cut them as round by
        round would; a lane that finishes in one discards the later ones') and its session moves to the last
        round's positions: the work per lane is per launch. The stats and the policy's acceptance are still
        per round, over the lanes not finished before it."""
        P, lanes = group.proposals, group.lanes
        sessions = [lane.session for lane in lanes]
        verdicts = make_verdicts(records[:, :, PROPOSALS_COLUMN : PROPOSALS_COLUMN + P], records[:, :, ACCEPTED_COLUMN],
                                 records[:, :, NEXT_COLUMN], [s.frontier for s in sessions], self.dims.vocab_size)
        rounds, accepted = len(records), verdicts.accepted
        owed, drained = [], []  # per lane: the context rows its first round's draft consumed: pending, drained
        live = []  # per lane: the rounds whose verdicts it keeps (0: finished before this launch)
        last = {}  # lane index -> the tokens it kept of its last round, for a lane that finished in this launch
        for i, (lane, s, tokens) in enumerate(zip(lanes, sessions, verdicts.tokens)):
            owed.append(s.frontier - s.draft_position)
            drained.append(s.drained_rows)
            s.draft_position, s.frontier, s.drained_rows = verdicts.starts[-1][i], verdicts.frontier[i], 0
            if lane.finish is not None:
                # Launched before the lane's finishing cycle was read (lag): its tokens are discarded and
                # the session rewound after the loop, so it is no cycle of the stats.
                live.append(0)
                continue
            kept = lane.add(tokens)
            if lane.finish is None:
                live.append(rounds)
            else:
                until, last[i] = rounds_kept(kept, [a[i] + 1 for a in accepted])
                live.append(until)
        choices = [lane.flight[0].choice for lane in lanes]
        accept = getattr(self.policy, "accept", None)
        yielded = owner_rounds = 0
        for r, members in _round_members(live, rounds):
            counts = _pick(accepted[r], members)
            if not counts:
                continue
            pending = _pick(owed if r == 0 else [a + 1 for a in accepted[r - 1]], members)
            self.log.cycle_counters(len(counts), P, sum(pending), counts, self.tap_row_bytes)
            modes = context_rows = emitted = positions = None
            if self.log.cycle_table:  # the rows' columns, where the log keeps rows
                rows = _pick(drained, members) if r == 0 else [0] * len(counts)
                positions = _pick(verdicts.starts[r], members)
                modes = cycle_modes(positions, self.dims.block_size, self.dims.max_context, rows)
                context_rows = [p + d for p, d in zip(pending, rows)]
                indices = range(len(lanes)) if members is None else members
                emitted = [last[i] if i in last and live[i] == r + 1 else a + 1 for i, a in zip(indices, counts)]
            # One device unit: the draft is not timed apart inside a cycle's graph (the whole cycle is verify_ms).
            self.log.cycle_rows(_pick(sessions, members), modes, context_rows, counts, emitted, positions, P, 0.0, device_ms,
                                owners=len(lanes), choices=_pick(choices, members))
            if accept is not None:
                accept(P, counts)
            yielded, owner_rounds = yielded + sum(counts) + len(counts), owner_rounds + len(counts)
        return yielded, owner_rounds

    def _read_decodes(self, group: Group, records: np.ndarray, device_ms: float) -> tuple[int, int]:
        """The launch's decode steps applied (a token per lane and round; ``device_ms`` per round); returns the
        tokens they yielded (one per lane and round not finished before it) and those lane-rounds' count.
        Each lane takes its rounds' tokens at once, as ``_read_cycles``' lanes do."""
        lanes, tokens = group.lanes, records[:, :, NEXT_COLUMN]  # [rounds, lanes]
        bad = (tokens < 0) | (tokens >= self.dims.vocab_size)
        if bad.any():
            r, i = (int(x) for x in np.argwhere(bad)[0])
            msg = f"decoded token of session {lanes[i].session.id} out of range: {int(tokens[r, i])} (valid [0, {self.dims.vocab_size - 1}])"
            raise ValueError(msg)
        rounds = len(tokens)
        starts, live = [], []  # per lane: its frontier before the launch; the rounds it keeps (one token each)
        for lane, new in zip(lanes, tokens.T.tolist()):
            s = lane.session
            starts.append(s.frontier)
            if s.speculate:
                # Each step wrote its tap at row frontier - draft of the context pool: one more pending row each.
                assert s.frontier + rounds - 1 - s.draft_position < self.dims.block_size, (s.id, s.frontier, s.draft_position, rounds)
                s.frontier += rounds
            else:
                s.frontier += rounds
                s.draft_position = s.frontier  # no drafting: no pending context
            live.append(0 if lane.finish is not None else lane.add(new))  # a finished lane's read-ahead steps are discarded
        sessions, choices = [lane.session for lane in lanes], [lane.flight[0].choice for lane in lanes]
        for r, members in _round_members(live, rounds):
            stepped = _pick(sessions, members)
            if not stepped:
                continue
            positions = [start + r for start in _pick(starts, members)] if self.log.cycle_table else None  # the rows' column, where the log keeps rows
            self.log.decode_rows(stepped, device_ms, len(lanes), _pick(choices, members), positions)
        return sum(live), sum(live)

    def _sampling_feeds(self, samplings: list[Sampling], positions: list[int]) -> dict[str, torch.Tensor]:
        """``cycles.sampling_rows`` as device tensors (small H2D copies on CUDA)."""
        return {name: torch.from_numpy(rows).to(self.device) for name, rows in sampling_rows(samplings, positions).items()}

    # ------------------------------------------------------------------ stats

    def clear_stats(self) -> None:
        """Start the stats tables afresh (e.g. after a warm-up whose captures should not be timed)."""
        self.log = StatsLog(self.log.max_rows, self.log.max_age_s, self.log.cycle_table)

    def cycle_stats(self) -> pl.DataFrame:
        """One row per owner per cycle (``runtime.stats.CYCLE_SCHEMA``), of the rows still in memory (none
        with ``cycle_table=False``)."""
        return self.log.frames()[0]

    def execute_stats(self) -> pl.DataFrame:
        """One row per execute() (``runtime.stats.EXECUTE_SCHEMA``), of the rows still in memory."""
        return self.log.frames()[1]

    def drain_stats(self, stem: str | Path | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Every row in memory as (cycles, executes), removed from the log; written to ``stats_paths(stem)`` when given.

        A long-running service drains periodically (e.g. one stem per hour) so
        the log's memory stays flat; undrained rows past ``stats_rows`` are
        dropped oldest first and counted in ``stats_dropped``.
        """
        cycles, executes = self.log.drain()
        if stem is not None:
            paths = stats_paths(stem)
            write_parquet(cycles, paths[0], "cycles")
            write_parquet(executes, paths[1], "executes")
        return cycles, executes

    def execute_rows(self, since: int | None, columns: Sequence[str]) -> ExecuteRows:
        """``columns`` of the execute rows from batch ``since`` on, and the cursor for the next read
        (``StatsLog.execute_rows``); safe from any thread."""
        return self.log.execute_rows(since, columns)

    @property
    def stats_dropped(self) -> dict[str, int]:
        """Rows the log's bound discarded (oldest batches first), per table."""
        with self.log.lock:
            return dict(self.log.dropped)

    def refused_calls(self) -> dict[str, int]:
        """API call name -> calls refused with a typed error that changed nothing (validation, BusyError)."""
        with self.log.lock:
            return dict(self.log.refused)

    def write_stats(self, stem: str | Path) -> tuple[Path, Path]:
        """Both tables (the rows in memory, kept) as Parquet at ``stats_paths(stem)``: (cycles, executes)."""
        cycles, executes = stats_paths(stem)
        frames = self.log.frames()
        return write_parquet(frames[0], cycles, "cycles"), write_parquet(frames[1], executes, "executes")
