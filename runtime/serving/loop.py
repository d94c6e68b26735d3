"""The serving loop: requests from any thread or coroutine, one executor, one loop.

Concurrency model: the ``ServingLoop`` owns ONE ``Executor`` and drives it from
ONE background thread, the serving loop; no other thread ever calls the
executor. Callers only touch a bounded queue and their request handles:

    caller threads / event loops                serving loop (one thread)
    ----------------------------                -------------------------
    submit() -> RequestHandle  --queue-->       cancels: close their sessions
    handle.cancel()            --flag-->        joins: queued requests open sessions (room permitting)
    iterate / await the handle <--deltas--      execute(one batch of every running request)
                                                deliver tokens (+ text, stop strings); finished leave

Continuous batching is ``serving.batcher.Batcher`` (the same code ``generate()``
runs): between two execute() calls finished and cancelled requests leave and
queued ones join; running requests feed only their pending token, so a call
mixes new prompts with the speculative fast path. A request that arrives while
an execute runs joins it at a later round when a session is free
(``join_running``: the executor opens its session and prefills it between two
rounds), so executes need not end for arrivals.

- Backpressure: at most ``max_queue`` requests wait for a session; ``submit``
  raises ``QueueFullError`` beyond that (nothing is queued). A request that
  a free session will take at the next gap does not wait: with
  ``max_queue=0`` a request is accepted exactly when a session is free.
- Cancel: a queued request leaves at once; a running one at the next gap
  between execute() calls (its session is closed there), which the running
  execute brings forward to the end of its current round (so does a stop
  string found while it streams): no lane decodes for a request that is gone.
- Failure isolation: an execute() that fails poisons the sessions of that
  batch (``Executor``); the loop closes them and replays each of those
  requests ALONE (its prompt + the tokens it already received, same seed:
  the same positions, so the same output), one execute each, before anything
  else runs. A request that fails alone fails with the error
  (``PoisonedError`` naming the cause); the others carry on, so one bad
  request does not fail its neighbours. The loop keeps serving.
- ``close(drain=True)`` refuses new requests and finishes the accepted ones;
  ``drain=False`` cancels them. The backend stays the caller's to close.

Outputs do not depend on batching: a request's tokens are those of the same
request run alone (and of the target-only reference, greedy or sampled with
the same seed).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from dflash_trt.checks import is_int
from dflash_trt.errors import DFlashError, ServingClosedError, InputError, QueueFullError, TokenizerError
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.finish import LENGTH, STOP
from dflash_trt.runtime.serving.batcher import ADMIT_TOKENS_PER_ROUND, Batcher, Chunk, Request, check_request
from dflash_trt.runtime.serving.handle import CANCELLED, Completion, Delta, RequestHandle
from dflash_trt.runtime.serving.metrics import ExecuteTotals, MetricsRecorder, ServingMetrics
from dflash_trt.runtime.serving.text import TextStream, detokenize, stop_strings
from dflash_trt.runtime.stats import lane_rounds

__all__ = ["CANCELLED", "Delta", "ServingLoop", "RequestHandle"]

DEFAULT_MAX_QUEUE = 256
DEFAULT_STREAM_INTERVAL = 0.015  # s between a request's deliveries inside one execute: a stream's longest gaps are ~ this plus a round


@dataclass
class _Job:
    """A request as the loop tracks it."""

    handle: RequestHandle
    request: Request
    text: TextStream | None
    submitted: float
    cancelled: str | None = None  # the finish it ends with once cancelled: CANCELLED, or STOP (the caller found a stop string)
    last_delivery: float | None = None
    suspect: BaseException | None = None  # the error of a failed batch it was in: replayed alone next


def _nothing() -> None:
    pass


class ServingLoop:
    """Serve requests over one executor from a background thread (see the module docstring).

    ``tokenizer`` (``export.tokenizer.Tokenizer``) enables text prompts,
    text deltas and stop strings. ``stop_ids``: the default stop tokens
    (default: the tokenizer's stop ids, none without a tokenizer).
    ``max_running`` caps sessions at once (default: the executor's
    max_sessions). Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        executor: Executor,
        tokenizer=None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_running: int | None = None,
        stop_ids: Sequence[int] | None = None,
        stream_interval: float = DEFAULT_STREAM_INTERVAL,
        handles: Callable[..., RequestHandle] = RequestHandle,
        early_join: bool = True,
        join_running: bool = True,
        flush: Callable[[], None] | None = None,
    ) -> None:
        """``stream_interval``: seconds between two deliveries of the running requests' tokens while an
        execute runs (every request's tokens read since go out together, this often; a request's first
        token and its end at once): the gap a client sees is bounded without a delivery per launch per request.
        ``early_join``: end an execute after its current round when a queued request could take a
        session at the gap (``Executor.execute_outputs``' ``should_yield``), so a joining request waits
        about one round for its session rather than the rest of the execute (up to ``max_cycles``).
        ``join_running``: a request that arrives while an execute runs joins it at its next round
        (``Executor.execute_outputs``' ``admit``) when a session is free: no execute ends for it.
        ``handles(request_id, prompt, cancel)`` makes each request's handle (a ``RequestHandle``
        subclass sees every delivery on the loop's thread: ``server.serving_process`` forwards them).
        ``flush()`` is called on the loop's thread after each burst of deliveries (``Executor.execute_outputs``'
        ``on_streamed``: before the next device wait), before each launch while an execute runs and after each
        round (``server.serving_process`` sends its handles' deliveries and reads its pipes then)."""
        if not is_int(max_queue) or max_queue < 0:
            msg = f"max_queue must be an int >= 0, got {max_queue!r}"
            raise InputError(msg)
        self.executor, self.tokenizer, self.max_queue = executor, tokenizer, max_queue
        self.stop_ids = tuple(stop_ids if stop_ids is not None else tokenizer.stop_ids if tokenizer is not None else ())
        self.batcher = Batcher(executor, max_running)  # the loop thread's alone
        self.stream_interval = float(stream_interval)
        self.early_join, self.join_running = bool(early_join), bool(join_running)
        self.recorder = MetricsRecorder()
        self._handles = handles
        self._flush = flush if flush is not None else _nothing
        self._executes = ExecuteCursor(executor)
        self._cond = threading.Condition()  # guards everything below
        self._queue: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}  # running (or suspects), by handle id
        self._suspects: deque[_Job] = deque()  # the loop thread's alone: requests of a failed batch, to replay alone
        self._next_id = 0
        self._accepting = True
        self._stopping: str | None = None  # "drain" or "cancel"
        self._dropping = False  # a running request was cancelled since the last gap
        self._fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="dflash-trt-serving", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    def submit(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        stop: Sequence[str] | str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
    ) -> RequestHandle:
        """Queue one request; returns its handle at once (tokens stream into it).

        ``prompt``: text (needs the tokenizer) or token ids. ``stop``: stop
        strings (need the tokenizer; the text ends before them). ``stop_ids``:
        stop tokens (default: the serving loop's). ``seed`` None draws one.
        ``sampling``: one ``Sampling`` value in place of temperature, top_k,
        top_p and seed (the HTTP schema's).
        Raises InputError / SamplingError / TokenizerError for bad values,
        QueueFullError when ``max_queue`` requests are waiting,
        ServingClosedError after ``close()``. Nothing is queued on a refusal.
        """
        if sampling is None:
            sampling = Sampling(temperature, top_k, top_p, secrets.randbits(63) if seed is None else seed)
        request, stops = self._request(prompt, max_new_tokens, stop, sampling, stop_ids)
        with self._cond:
            if not self._accepting:
                self.recorder.count("rejected")
                raise ServingClosedError(self._closed_message())
            free = max(0, self.batcher.capacity - len(self._jobs))  # sessions the next gap hands out
            if len(self._queue) - free >= self.max_queue:
                self.recorder.count("rejected")
                waiting = len(self._queue) - free
                msg = f"the request queue is full ({waiting} waiting for a session, max_queue {self.max_queue}); retry later"
                raise QueueFullError(msg)
            handle = self._handles(self._next_id, list(request.prompt), self._cancel)
            self._next_id += 1
            text = TextStream(self.tokenizer, stops) if self.tokenizer is not None else None
            self._queue.append(_Job(handle, request, text, time.perf_counter()))
            self._cond.notify_all()
        self.recorder.count("submitted")
        self.recorder.count("prompt_tokens", len(request.prompt))
        return handle

    def start_submit(self, *args, **kwargs) -> Future:
        """``submit``'s handle as a done Future (``server.front.ServingClient.start_submit``'s shape: there
        the serving process answers later); a refusal raises here, as ``submit``'s does."""
        answer: Future = Future()
        answer.set_result(self.submit(*args, **kwargs))
        return answer

    def _request(self, prompt, max_new_tokens, stop, sampling: Sampling, stop_ids) -> tuple[Request, tuple[str, ...]]:
        """Validate everything in the caller's thread: the loop only ever sees runnable requests."""
        dims = self.executor.dims
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError("prompt is text but the serving loop has no tokenizer: pass token ids or ServingLoop(tokenizer=...)", param="prompt")
            prompt = self.tokenizer.encode(prompt)
        stops = stop_strings(stop, self.tokenizer)
        stop_ids = self.stop_ids if stop_ids is None else stop_ids
        request = Request(prompt, max_new_tokens, stop_ids, sampling)
        return check_request(0, request, dims.max_context, dims.vocab_size), stops  # plain values, every field checked

    def _cancel(self, handle: RequestHandle, finish: str = CANCELLED) -> None:
        """RequestHandle.cancel: a queued request finishes now; a running one at the next gap (with
        ``finish``: CANCELLED, or STOP when the caller ended it at a stop string it found)."""
        with self._cond:
            queued = next((job for job in self._queue if job.handle is handle), None)
            if queued is not None:
                self._queue.remove(queued)
            elif handle.id in self._jobs:
                self._jobs[handle.id].cancelled = finish
                self._dropping = True  # the running execute ends after its round (``_step``'s should_yield)
                self._cond.notify_all()
        if queued is not None:
            self._finish(queued, [], finish)

    def metrics(self) -> ServingMetrics:
        """One consistent snapshot: requests running/queued, totals, tokens/s, τ, latency percentiles."""
        with self._cond:
            running, queued = len(self._jobs), len(self._queue)
        return self.recorder.snapshot(running, queued)

    @property
    def thread(self) -> threading.Thread:
        """The serving loop's thread (the only one that calls the executor): for profilers and CPU-time readers."""
        return self._thread

    @property
    def idle(self) -> bool:
        """No request queued or running: the loop's thread waits for one (or ends, if closing)."""
        with self._cond:
            return not (self._queue or self._jobs)

    @property
    def healthy(self) -> bool:
        """The serving loop is alive (it stops only after close() or an internal error)."""
        return self._thread.is_alive() and self._fatal is None

    def close(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Refuse new requests; finish (``drain``) or cancel the accepted ones; stop the loop. Waits up to
        ``timeout`` seconds (None: until it stopped); True once the loop's thread has ended (a cancel
        takes effect at the next gap between executes, so the executor is free only then)."""
        with self._cond:
            self._accepting = False
            if self._stopping != "cancel":
                self._stopping = "drain" if drain else "cancel"
            self._dropping = self._dropping or not drain  # cancelling: the running execute ends after its round
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> ServingLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close(drain=exc[0] is None)

    def _closed_message(self) -> str:
        if self._fatal is not None:
            return f"the serving loop stopped after an internal error: {type(self._fatal).__name__}: {self._fatal}"
        return "the serving loop is closed: it accepts no new requests"

    # ------------------------------------------------------------------ the serving loop

    def _serve(self) -> None:
        try:
            while self._round():
                self._flush()
        except BaseException as error:  # a bug in the loop itself: fail every request, accept none
            self._stop_everything(error)
            raise
        finally:
            self._flush()

    def _round(self) -> bool:
        """One gap between execute() calls, then one execute(); False when the loop should end."""
        with self._cond:
            while not (self._queue or self._jobs or self._stopping):
                self._cond.wait()
            if self._stopping == "cancel":
                for job in self._queue:
                    job.cancelled = job.cancelled or CANCELLED
                for job in self._jobs.values():
                    job.cancelled = job.cancelled or CANCELLED
            leaving = [job for job in self._jobs.values() if job.cancelled]
            self._dropping = False  # the cancelled leave at this gap
            dropped = [job for job in self._queue if job.cancelled]
            self._queue = deque(job for job in self._queue if not job.cancelled)
            room = 0 if self._suspects else min(len(self._queue), self.batcher.room + len(leaving))  # replays first
            joining = [self._queue.popleft() for _ in range(room)]
            self._jobs.update((job.handle.id, job) for job in joining)  # a cancel from now on flags them
            if not (self._queue or self._jobs or joining):
                return False
        for job in leaving:
            if job.suspect is None:
                self.batcher.leave(job.handle.id)
            else:
                self._suspects.remove(job)
            self._finish(job, [], job.cancelled)
        for job in dropped:
            self._finish(job, [], job.cancelled)
        for job in joining:
            self._join(job)
        if self._suspects:
            self._replay(self._suspects.popleft())
        elif self.batcher.running:
            self._step()
        return True

    def _join(self, job: _Job) -> None:
        try:
            self.batcher.join(job.handle.id, job.request)
        except DFlashError as error:  # validated at submit; a refusal here fails this request only
            self._fail([job], error)
            return
        self.recorder.joined(time.perf_counter() - job.submitted)

    def _step(self) -> None:
        ended: set = set()  # requests that ended while the execute streamed: their sessions close after it
        orphaned: list = []  # of those, the ones whose lanes the executor still runs (cut at a stop string)
        started = time.perf_counter()

        def should_yield(finished: int) -> bool:
            """End the execute after this round when one of its requests no longer wants tokens (cancelled,
            or cut at a stop string while the executor still decodes it: its lane would run for nobody
            until the execute's end, up to ``max_cycles`` launches); and, with early join, when queued
            requests could take sessions at the gap (free ones, or those of requests that ended during
            it: ``Batcher.should_yield``, for a share of the batch's worth of them or the oldest after
            ``JOIN_WAIT_S``): their first tokens then wait a round or a few, not the rest of the execute.
            ``ended`` counts every request the executor ended (a chunk with a finish is delivered at
            once) and those cut at a stop string. Asked before each launch: the pipes a flush reads are read first."""
            self._flush()
            now = time.perf_counter()
            with self._cond:
                # Requests that will join the running execute (a free session each) need no gap.
                waiting = max(0, len(self._queue) - admissible())
                oldest = self._queue[-waiting].submitted if waiting else now
                dropping = self._dropping
            if dropping or orphaned:
                return True
            if not self.early_join:
                return False
            # Waited for this execute: since it started, or since the request came if later.
            return self.batcher.should_yield(waiting, max(finished, len(ended)), now - max(oldest, started))

        def admissible() -> int:
            return self.batcher.room if self.join_running and self._stopping != "cancel" else 0

        def admit(limit: int) -> list[tuple[int, Request]]:
            """Queued requests joining the running execute (``Batcher.step``'s admit): up to ``limit``
            (the free sessions), oldest first, while their prompts fit ADMIT_TOKENS_PER_ROUND (the first
            always: a round's streams wait for one bounded prefill); as the gap's early join would take
            them (``Batcher.should_yield``: a share of the running requests' worth, or the oldest after
            JOIN_WAIT_S), so prompts are prefilled a batch at a time, not one launch per round; none once
            the loop cancels what it accepted."""
            if not self._queue:  # asked every launch, mostly with none waiting: no lock then (a submit racing this joins the next round)
                return []
            taken, budget, now = [], ADMIT_TOKENS_PER_ROUND, time.perf_counter()
            with self._cond:
                if self._stopping == "cancel" or not self._queue:
                    return []
                if not self.batcher.should_yield(len(self._queue), 0, now - self._queue[0].submitted):
                    return []
                while self._queue and len(taken) < limit and (not taken or len(self._queue[0].request.prompt) <= budget):
                    budget -= len(self._queue[0].request.prompt)
                    taken.append(self._queue.popleft())
                self._jobs.update((job.handle.id, job) for job in taken)  # a cancel from now on flags them
            for job in taken:
                self.recorder.joined(now - job.submitted)
            return [(job.handle.id, job.request) for job in taken]

        def stream(key, tokens: list[int], finish: str | None) -> None:
            """A request's tokens while the execute runs (``Batcher.step``'s on_chunk): its first ones and
            those that end it as soon as they are read, the others every ``stream_interval``, every
            request's together (the executor holds them: ``Executor.execute_outputs``' stream_interval), so
            deliveries come in one burst per tick and an HTTP front gets one message per tick, not one per
            round (each a wake-up, a pickle and a send on threads that share the serving loop's GIL)."""
            if key in ended:
                return
            if self._deliver(self._jobs[key], Chunk(key, tokens, finish), streaming=True):
                ended.add(key)
                if finish is None:  # cut at a stop string: the executor still decodes it
                    orphaned.append(key)

        try:
            chunks = self.batcher.step(on_chunk=stream, should_yield=should_yield, admit=admit if self.join_running else None,
                                       stream_interval=self.stream_interval, on_streamed=self._flush)
        except Exception as error:
            failed = [self._jobs[key] for key in list(self.batcher.running)]
            for job in failed:
                self.batcher.leave(job.handle.id)  # poisoned sessions are closed here
            self._record_executes()
            error = _typed(error)
            if len(failed) == 1:
                self._fail(failed, error)  # it ran alone: the request itself fails
                return
            for job in failed:
                job.suspect = error
            self._suspects.extend(failed)
            return
        self._record_executes()
        for chunk in chunks:
            tokens = chunk.tokens
            if chunk.error is not None:  # admitted, refused by the executor: it ran nothing (its session closed)
                self._fail([self._jobs[chunk.index]], chunk.error)
            elif chunk.index in ended:
                if chunk.index in self.batcher.running:
                    self.batcher.leave(chunk.index)
            elif tokens or chunk.finish is not None:
                self._deliver(self._jobs[chunk.index], Chunk(chunk.index, tokens, chunk.finish))

    def _replay(self, job: _Job) -> None:
        """Run one request of a failed batch alone, from its prompt + the tokens it already received.

        The same seed at the same positions gives the same tokens, so its output is as if nothing
        failed; if it fails alone, it fails (with the new error, chained like any execute failure).
        """
        key, request, received = job.handle.id, job.request, job.handle.tokens
        if len(received) >= request.max_new_tokens:  # every token had streamed before the batch failed
            self._finish(job, [], LENGTH)
            return
        replay = replace(request, prompt=[*request.prompt, *received], max_new_tokens=request.max_new_tokens - len(received))
        if len(replay.prompt) > self.executor.dims.max_context - 1:  # no room to replay it as a prompt
            self._fail([job], job.suspect)
            return
        try:
            self.batcher.join(key, replay)
            chunks = self.batcher.step([key])
        except Exception as error:
            if key in self.batcher.running:
                self.batcher.leave(key)
            self._record_executes()
            self._fail([job], _typed(error))
            return
        self._record_executes()
        job.suspect = None
        for chunk in chunks:
            self._deliver(job, chunk)

    def _deliver(self, job: _Job, chunk: Chunk, streaming: bool = False) -> bool:
        """Tokens to the handle (after each launch while an execute runs: ``streaming``; or after it):
        text deltas, stop strings, finish. True when the request ended while streaming (the executor
        is busy: the caller closes its session after the execute)."""
        tokens, finish, text = chunk.tokens, chunk.finish, None
        stopped = False
        if job.text is not None:
            tokens, text, stopped = detokenize(job.text, tokens, chunk.finish == STOP)
            if stopped and finish is None and not streaming:
                self.batcher.leave(job.handle.id)
            finish = STOP if stopped else finish
            if finish is not None and not stopped:
                text += job.text.flush()
        now = time.perf_counter()
        first = job.last_delivery is None
        self.recorder.delivered(now, len(tokens), now - job.submitted if first else None, None if first else now - job.last_delivery)
        job.last_delivery = now
        if finish is None:
            job.handle._push(Delta(tokens, text, None))
        else:
            self._finish(job, tokens, finish, text)
        return streaming and finish is not None

    def _finish(self, job: _Job, tokens: list[int], finish: str, text: str | None = None) -> None:
        with self._cond:
            self._jobs.pop(job.handle.id, None)
        if text is None and job.text is not None:
            text = "" if finish == CANCELLED else job.text.flush()
        job.handle._push(Delta(tokens, text, finish))
        job.handle._complete(Completion(job.handle.tokens, finish, job.handle.text if job.text is not None else None))
        self.recorder.finished("cancelled" if finish == CANCELLED else "completed", time.perf_counter() - job.submitted)

    def _fail(self, jobs: list[_Job], error: BaseException) -> None:
        with self._cond:
            for job in jobs:
                self._jobs.pop(job.handle.id, None)
        for job in jobs:
            job.handle._fail(error)
        self.recorder.count("failed", len(jobs))

    def _record_executes(self) -> None:
        self.recorder.executed(self._executes.read())

    def _stop_everything(self, error: BaseException) -> None:
        with self._cond:
            self._fatal, self._accepting = error, False
            jobs = [*self._queue, *self._jobs.values()]
            self._queue.clear()
        self._fail(jobs, _wrap(error))
        try:
            self.batcher.close()
        except Exception:  # the loop is already broken; the sessions die with the executor
            pass


def _wrap(error: BaseException) -> DFlashError:
    wrapped = DFlashError(f"the serving loop failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def _typed(error: BaseException) -> DFlashError:
    """A failed execute's error as the requests see it: typed errors as they are, others wrapped."""
    return error if isinstance(error, DFlashError) else _wrap(error)


class ExecuteCursor:
    """The executor's per-execute counters (``runtime.stats`` execute table) not yet read.

    Reads through ``Executor.execute_rows`` by batch id, so the log's bounds
    dropping old rows, or a drain emptying it, never makes a row count twice;
    rows dropped or drained by someone else before this read are not counted.
    """

    COLUMNS = ("cycles", "accepted", "ok", "policy_cycles", "policy_decodes", "policy_verified", "drafting_stopped", "loop_device_us",
               "loop_launches", "loop_rounds", "target_decode_steps")

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.next_batch = executor.execute_rows(None, ()).next_batch

    def read(self) -> ExecuteTotals:
        """The counters of the executes that ended since the last read."""
        rows = self.executor.execute_rows(self.next_batch, self.COLUMNS)
        self.next_batch = rows.next_batch
        columns = rows.columns
        cycles = sum(columns["cycles"])
        return ExecuteTotals(
            cycles=cycles,
            accepted=sum(columns["accepted"]),
            executes=len(columns["ok"]),
            failed=sum(not ok for ok in columns["ok"]),
            choices={"cycle": sum(columns["policy_cycles"]), "decode": sum(columns["policy_decodes"])},
            verified=sum(columns["policy_verified"]),
            stopped=sum(columns["drafting_stopped"]),
            device_s=sum(columns["loop_device_us"]) / 1e6,
            launches=sum(columns["loop_launches"]),
            rounds=sum(columns["loop_rounds"]),
            lane_rounds=lane_rounds(cycles, sum(columns["target_decode_steps"])),
        )
