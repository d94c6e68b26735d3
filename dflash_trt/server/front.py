"""The HTTP front's side of the serving process: ``ServingClient`` stands where ``server.app`` holds a ``ServingLoop``.

``dflash-trt serve`` (``--front-process``, the default) starts the serving
process (``server.serving_process``: the executor and its loop) and serves
HTTP in this process over a ``ServingClient``. The app sees the same
interface as an in-process ``ServingLoop`` — ``submit`` returning a
``RequestHandle``, ``cancel``, ``metrics()``, ``healthy``, ``close``,
``tokenizer``, ``executor.{speculate, max_sessions, dims.max_context}`` — so
every route, error, stream and drain works as before; the messages are
``server.wire``'s.

Detokenizing and stop strings are done here (``runtime.serving.text``, the
loop's own code): the serving process sends token ids only, one message per
delivery round for every request. A stop string found here ends the request
at once (finish ``stop``, the text cut before it) and tells the serving
process to end it (``Cancel(key, "stop")``, counted as completed there).

The serving process's death (its pipe closes) fails every open request with
``ServingClosedError`` (code ``serving_process_died``: a 503, or a last error
event on a stream), makes ``healthy`` False and calls ``on_death`` (the
server then exits 1, as vLLM's does when its engine core dies).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial

from dflash_trt.errors import ServingClosedError, ServingError, TokenizerError
from dflash_trt.export.sampling_params import Sampling
from dflash_trt.runtime.finish import STOP
from dflash_trt.runtime.serving.handle import CANCELLED, Completion, Delta, RequestHandle
from dflash_trt.runtime.serving.text import TextStream, detokenize, stop_strings
from dflash_trt.server import serving_process, wire
from dflash_trt.server.children import ended, exit_code

log = logging.getLogger("dflash_trt.server")

STOP_JOIN_S = 1.0  # on stop: how long the serving process gets to exit before it is killed
DIED = wire.DIED


@dataclass(frozen=True)
class Dims:
    max_context: int
    vocab_size: int


@dataclass(frozen=True)
class ExecutorSummary:
    """What the HTTP layer reads of the serving process's executor (``Ready``)."""

    speculate: bool
    max_sessions: int
    dims: Dims


@dataclass
class _Job:
    handle: RequestHandle
    text: TextStream | None


class ServingClient:
    """The front's stand-in for a ``ServingLoop`` in another process (see the module docstring)."""

    def __init__(self, process, conn, ready: wire.Ready, tokenizer=None, on_death: Callable[[], None] | None = None) -> None:
        """``process``: the serving process when this front owns it (it may stop it), None in another
        front (``serve --fronts``): its liveness is then its pipe's."""
        self.process, self.conn, self.tokenizer, self.on_death = process, conn, tokenizer, on_death
        self.pid = ready.pid
        self.executor = ExecutorSummary(ready.speculate, ready.max_sessions, Dims(ready.max_context, ready.vocab_size))
        self._lock = threading.Lock()  # guards everything below
        self._send_lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}  # open requests by key
        self._submits: dict[int, tuple[Future, RequestHandle]] = {}  # unanswered submits by key: (answer, handle)
        self._answers: dict[tuple[type, int], Future] = {}  # (MetricsQuery, seq) -> its answer
        self._next = 0
        self._died: ServingClosedError | None = None
        self._stopping = False
        self._dispatch = {wire.Deliveries: self._deliveries, wire.Refused: self._refused, wire.MetricsReply: self._metrics_reply}
        self._receiver = threading.Thread(target=self._receive, name="dflash-trt-front-receiver", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------------ the ServingLoop interface

    def submit(self, prompt: str | Sequence[int], max_new_tokens: int = 64, stop: Sequence[str] | str | None = None,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop_ids: Sequence[int] | None = None, sampling: Sampling | None = None) -> RequestHandle:
        """``ServingLoop.submit`` across the pipe: the serving process checks and queues it (its typed
        refusal is raised here); blocks for that answer (call it from a worker thread; an event loop
        awaits ``start_submit``'s Future instead)."""
        answer = self.start_submit(prompt, max_new_tokens, stop, temperature, top_k, top_p, seed, stop_ids, sampling)
        try:
            return answer.result(wire.ANSWER_TIMEOUT_S)
        except FutureTimeout:
            if not answer.cancel():  # answered just now
                return answer.result()
            raise wire.unanswered() from None  # withdrawn: a Cancel follows the Submit (the pipe keeps order)

    def start_submit(self, prompt: str | Sequence[int], max_new_tokens: int = 64, stop: Sequence[str] | str | None = None,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stop_ids: Sequence[int] | None = None, sampling: Sampling | None = None) -> Future:
        """``submit`` without waiting: the Submit is sent and the returned Future gets the request's handle
        once the serving process takes it, or its refusal's typed error (``ServingClosedError`` when the
        process dies). Cancelling the Future withdraws the request (a Cancel follows the Submit); whoever
        waits bounds the wait (``wire.ANSWER_TIMEOUT_S``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError("prompt is text but this server has no tokenizer: send token ids", param="prompt")
            prompt = self.tokenizer.encode(prompt)
        stops = stop_strings(stop, self.tokenizer)
        if sampling is None:
            sampling = Sampling(temperature, top_k, top_p, secrets.randbits(63) if seed is None else seed)
        prompt = list(prompt)
        answer: Future = Future()
        with self._lock:
            self._check_alive()
            key, self._next = self._next, self._next + 1
            handle = RequestHandle(key, prompt, self._cancel)
            self._jobs[key] = _Job(handle, TextStream(self.tokenizer, stops) if self.tokenizer is not None else None)
            self._submits[key] = (answer, handle)
        answer.add_done_callback(partial(self._withdrawn, key))
        self._send(wire.Submit(key, prompt, max_new_tokens, sampling, None if stop_ids is None else tuple(stop_ids)))
        return answer

    def metrics(self):
        """The serving process's ``ServingMetrics`` (blocks for its answer: call it off the event loop)."""
        with self._lock:
            self._check_alive()
            seq, self._next = self._next, self._next + 1
            answer = self._answers[(wire.MetricsQuery, seq)] = Future()
        self._send(wire.MetricsQuery(seq))
        try:
            return answer.result(wire.ANSWER_TIMEOUT_S).metrics
        except FutureTimeout:
            raise wire.unanswered() from None
        finally:
            with self._lock:
                self._answers.pop((wire.MetricsQuery, seq), None)

    @property
    def healthy(self) -> bool:
        return self._died is None and (self.process is None or not ended(self.process))

    @property
    def died(self) -> bool:
        """The serving process ended without being asked to (``stop``)."""
        return self._died is not None and not self._stopping

    def close(self, drain: bool = True, timeout: float | None = 0) -> bool:
        """Refuse new requests; the serving process finishes (``drain``) or cancels the accepted ones.
        Does not wait (``stop`` ends the process); True when the process has already ended."""
        self._send(wire.Close(drain))
        return not self.healthy

    def stop(self, timeout: float = STOP_JOIN_S) -> None:
        """End the serving process: ``Exit`` (it cancels what is left and frees its backend), killed if it
        has not exited within ``timeout``."""
        self._stopping = True
        if self.process is None:  # another front's: its pipe ends, the serving process cancels its requests
            _shut_down(self.conn)
            self._receiver.join(timeout)
            self.conn.close()
            return
        self._send(wire.Exit())
        if not ended(self.process, timeout):
            log.warning("the serving process did not exit within %.1f s; killing it", timeout)
            self.process.kill()
        exit_code(self.process)
        self._receiver.join(timeout)

    # ------------------------------------------------------------------ the pipe

    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the serving process is gone: the receiver fails what is open
            pass

    def _check_alive(self) -> None:
        """Under ``_lock``."""
        if self._died is not None:
            raise self._died

    def _cancel(self, handle: RequestHandle, finish: str = CANCELLED) -> None:
        with self._lock:
            open_ = handle.id in self._jobs
        if open_:
            self._send(wire.Cancel(handle.id, finish))

    def _receive(self) -> None:
        """The receiver thread: every message from the serving process until its end of the pipe closes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch[type(message)](message)
            except Exception:  # noqa: BLE001  (a dead receiver would leave every request of this front hanging)
                log.exception("handling a %s from the serving process failed; the front goes on", type(message).__name__)
        self._die()

    def _metrics_reply(self, message: wire.MetricsReply) -> None:
        with self._lock:
            answer = self._answers.get((wire.MetricsQuery, message.seq))
        if answer is not None:
            _settle(answer, message)

    def _accepted(self, key: int) -> None:
        """The serving process took submit ``key``: its Future gets the handle."""
        with self._lock:
            answer, handle = self._submits.pop(key, (None, None))
        if answer is not None:
            _settle(answer, handle)

    def _refused(self, message: wire.Refused) -> None:
        with self._lock:
            answer, _ = self._submits.pop(message.key, (None, None))
            self._jobs.pop(message.key, None)
        if answer is not None:
            _settle(answer, error=message.error.error())

    def _withdrawn(self, key: int, answer: Future) -> None:
        """A submit's Future is done: when it was cancelled (its caller stopped waiting), forget the request
        and end it in the serving process (the Cancel follows the Submit, so it ends there whatever it did)."""
        if not answer.cancelled():
            return
        with self._lock:
            self._submits.pop(key, None)
            job = self._jobs.pop(key, None)
        if job is not None:
            self._send(wire.Cancel(key, CANCELLED))

    def _deliveries(self, message: wire.Deliveries) -> None:
        for key in message.accepted:  # before the items: a request's first tokens may come in the message that accepts it
            self._accepted(key)
        for key, tokens, finish in message.items:
            with self._lock:
                job = self._jobs.get(key)
            if job is not None:  # else it ended here at a stop string: the serving process's late tokens
                try:
                    self._deliver(key, job, tokens, finish)
                except Exception as error:  # noqa: BLE001  (one request fails, the message's others are delivered)
                    self._delivery_failed(key, job, finish, error)
        for key, error in message.failures:
            with self._lock:
                job = self._jobs.pop(key, None)
            if job is not None:
                job.handle._fail(error.error())

    def _deliver(self, key: int, job: _Job, tokens: list[int], finish: str | None) -> None:
        """Tokens to the handle: text deltas, stop strings, finish (``ServingLoop._deliver``'s rules)."""
        text = None
        if job.text is not None:
            tokens, text, stopped = detokenize(job.text, tokens, finish == STOP)
            if stopped and finish is None:
                self._send(wire.Cancel(key, STOP))
            if stopped:
                finish = STOP
            elif finish not in (None, CANCELLED):
                text += job.text.flush()
        if finish is None:
            job.handle._push(Delta(tokens, text, None))
            return
        with self._lock:
            self._jobs.pop(key, None)
        job.handle._push(Delta(tokens, text, finish))
        job.handle._complete(Completion(job.handle.tokens, finish, job.handle.text if job.text is not None else None))

    def _delivery_failed(self, key: int, job: _Job, finish: str | None, error: Exception) -> None:
        """Delivering a request's tokens raised (a bug, e.g. in detokenizing): that request fails with a
        ServingError naming the cause, the serving process stops decoding it, every other request goes on."""
        log.exception("delivering the tokens of request %d failed; it fails, the others go on", job.handle.id)
        with self._lock:
            self._jobs.pop(key, None)
        if finish is None:
            self._send(wire.Cancel(key, CANCELLED))
        if not job.handle.done:
            job.handle._fail(ServingError(f"delivering the request's tokens failed: {type(error).__name__}: {error}"))

    def _die(self) -> None:
        """The pipe closed: fail every open request and answer, once; report an unexpected death."""
        if self.process is not None:
            code = exit_code(self.process) if ended(self.process, STOP_JOIN_S) else "none yet"
            error = ServingClosedError(f"the serving process stopped (exit code {code})", code=DIED)
        else:
            error = ServingClosedError("the serving process stopped (its pipe closed)", code=DIED)
        with self._lock:
            self._died = error
            jobs, self._jobs = list(self._jobs.values()), {}
            answers = [answer for answer, _ in self._submits.values()] + list(self._answers.values())
            self._submits, self._answers = {}, {}
        if not self._stopping:  # reported before the requests fail: whoever sees a failure sees the death
            log.error("%s; %d open requests fail", error, len(jobs))
            if self.on_death is not None:
                self.on_death()
        for job in jobs:
            job.handle._fail(error)
        for answer in answers:
            _settle(answer, error=error)


def _settle(answer: Future, value=None, error: BaseException | None = None) -> None:
    """Answer a waiting caller once; a Future already done (cancelled by a caller that stopped waiting) is left."""
    try:
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(value)
    except InvalidStateError:
        pass


def _shut_down(conn) -> None:
    """End a duplex pipe (a socket pair) both ways: a read blocked on it, here or at the other end, returns EOF."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def start(args: argparse.Namespace, logging_config: dict, fronts: int = 1) -> tuple[object, list, wire.Ready]:
    """Spawn the serving process and wait until it loaded: (process, the fronts' ends of the pipes, Ready).

    One pipe per HTTP front (``serve --fronts``); this process's is the first, and it has read its
    ``Ready`` (the others' wait in their pipes). Its start-up logs go to this process's stderr. Raises its
    loading error (the same typed error), or ServingError when it died while loading; a
    KeyboardInterrupt while waiting kills it."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of this process's threads
    pipes = [context.Pipe(duplex=True) for _ in range(fronts)]
    conns, child_conns = [a for a, _ in pipes], [b for _, b in pipes]
    process = context.Process(target=serving_process.main, args=(child_conns, child_args(args), logging_config), name="dflash-trt-serving")
    process.start()
    for child_conn in child_conns:
        child_conn.close()
    conn = conns[0]
    try:
        first = conn.recv()
    except EOFError:
        process.join()
        raise ServingError(f"the serving process exited while loading (exit code {process.exitcode}); see the log above") from None
    except BaseException:
        process.kill()
        process.join()
        raise
    if isinstance(first, wire.LoadFailed):
        process.join()
        raise first.error.error()
    return process, conns, first


def child_args(args: argparse.Namespace) -> argparse.Namespace:
    """The command's arguments as a spawned process can receive them (no callables)."""
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})


__all__ = ["DIED", "ServingClient", "start"]
