"""The serving process: the executor and its ``ServingLoop`` in a process of their own, driven over a pipe.

``dflash-trt serve`` (by default) runs the HTTP front (``server.front``) in its
own process and this one beside it, so the serving loop's thread never waits
for the GIL behind HTTP parsing, tokenizing, detokenizing or SSE work. The
messages are ``server.wire``'s.

Threads here: the main thread reads the pipes, one per HTTP front (submits,
cancels, closes, metrics queries), while the serving loop is idle; once a message
leaves it busy, the loop's thread reads them itself at its flushes (below) and the
main thread waits until the loop is idle again, so no message wakes a thread while
the loop works. Neither waits on a write: a submit's answer (its key, accepted;
or ``Refused``) and a metrics query's go to that front's outbox. ``Exit``,
``Close`` and a pipe's end are the main thread's to handle, whoever read them.
The serving loop's thread runs the executor and hands tokens to the
requests' handles (``ForwardingHandle``: each delivery also goes to its front's
outbox), and after each burst of them (before each launch, after each round:
``ServingLoop(flush=...)``) sends every front what its outbox holds as one
``Deliveries`` message (the acceptances with the tokens), on its own thread, as
far as the front's socket takes it without waiting. What a socket does not take
goes to that front's sender thread, which sends it blocking: a front that reads
slowly (its pipe full) holds up its own deliveries only, never the serving loop
or another front. No thread is woken per round (every wake-up is a hand-off of
the serving loop's GIL), and no message goes out per token or per request.
With ``serve --fronts N`` the first front owns the process; another
front's pipe closing (its process ended) cancels that front's requests only.

The process ignores SIGINT / SIGTERM: the front owns the shutdown (a signal
delivered to the whole process group must not kill the executor under open
streams) and says ``Close`` / ``Exit``. It ends when the first front's end of
the pipe closes (the front died) and, on Linux, when the front's process dies
while this one still loads (``PR_SET_PDEATHSIG``). It exits 1 when its
serving loop stops on an internal error (the front then sees EOF: the
process died).
"""

from __future__ import annotations

import ctypes
import logging
import logging.config
import os
import selectors
import signal
import socket
import struct
import threading
from collections import deque
from multiprocessing.reduction import ForkingPickler

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.serving.handle import CANCELLED, Delta, RequestHandle
from dflash_trt.server import wire

log = logging.getLogger("dflash_trt.server")

POLL_S = 0.5  # how often the main thread, waiting on the pipe, checks the serving loop's health
EXIT_JOIN_S = 0.5  # on Exit: how long the serving loop's running execute may take before the process exits anyway
PR_SET_PDEATHSIG = 1  # linux/prctl.h
MAIN, LOOP = "main", "loop"  # who reads the pipes (``ServingProcess._reader``)
READ_AT_MOST = 16  # rounds of one message a pipe the loop's thread reads at a flush (a burst of submits waits a few launches at most)


class Outbox:
    """What waits to go to one front: acceptances, deliveries, failures and answers (any thread puts), and
    what its socket did not take at once (``defer``: whole messages, after the unsent end of one).

    A put wakes nobody: whoever put flushes after its burst (``Front.flush``: the serving loop's thread
    before each launch and after each round, the main thread after a refusal, a cancel or a metrics query).
    ``wake`` hands what is here to the front's sender thread (``wait`` then ``take``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[wire.Item] = []
        self._failures: list[tuple[int, wire.WireError]] = []
        self._accepted: list[int] = []
        self._answers: list = []  # whole messages (``Refused``, ``MetricsReply``), sent before the deliveries
        self._rest = b""  # the unsent end of a message the socket took in part: first out
        self._backlog: list = []  # messages the socket did not take: out after ``_rest``, before the rest
        self._woken = False
        self._closed = False

    def accept(self, key: int) -> None:
        self._add("_accepted", key)

    def put(self, item: wire.Item) -> None:
        self._add("_items", item)

    def fail(self, key: int, error: wire.WireError) -> None:
        self._add("_failures", (key, error))

    def answer(self, message) -> None:
        """A message of its own to the front (a refusal, a metrics reply): the main thread never waits on a pipe."""
        self._add("_answers", message)

    def _add(self, into: str, value) -> None:
        """``value`` onto the list named ``into``, looked up under the lock: ``take`` replaces the lists, so a list
        fetched before the lock may be one a concurrent ``take`` has already sent (the value then lost)."""
        with self._cond:
            if not self._closed:  # closed: its front is gone (nothing would send it)
                getattr(self, into).append(value)

    @property
    def pending(self) -> bool:
        """Anything to send (read without the lock: a flush that misses a racing put is followed by the putter's own)."""
        return bool(self._items or self._failures or self._accepted or self._answers or self._backlog or self._rest)

    @property
    def behind(self) -> bool:
        """The sender holds or was handed messages: a later one must not overtake them."""
        return bool(self._backlog or self._rest or self._woken)

    def take(self) -> tuple[bytes, list]:
        """(the unsent end of a message, the messages in order): the backlog, the answers, then the rest as one
        ``Deliveries``; all of it leaves the outbox."""
        with self._cond:
            rest, messages = self._rest, self._backlog + self._answers
            self._rest, self._backlog, self._answers, self._woken = b"", [], [], False
            if self._items or self._failures or self._accepted:
                messages.append(wire.Deliveries(tuple(self._items), tuple(self._failures), tuple(self._accepted)))
                self._items, self._failures, self._accepted = [], [], []
            return rest, messages

    def defer(self, messages: list, rest: bytes = b"") -> None:
        """What the socket did not take (``rest``: the end of the message it took in part), to the sender, ahead
        of anything put since; the caller took ``messages`` and holds the front's lock (nothing is behind)."""
        with self._cond:
            self._rest, self._backlog, self._woken = rest, messages, True
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    def wait(self) -> bool:
        """The sender's: until woken with something to send (True), or closed with nothing left (False)."""
        with self._cond:
            while not (self.pending and (self._woken or self._closed)):
                if self._closed:
                    return False
                self._cond.wait()
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class ForwardingHandle(RequestHandle):
    """A request's handle in the serving process: every delivery also goes to the outbox under the
    front's ``key``; it forgets its deltas (the front keeps them), only its tokens stay (a replay needs them).
    ``finished``: where it appends ``name`` once it finished or failed (``ServingProcess`` forgets it then)."""

    def __init__(self, outbox: Outbox, key: int, request_id: int, prompt: list[int], cancel, finished: deque | None = None,
                 name: object = None) -> None:
        super().__init__(request_id, prompt, cancel)
        self.key, self.outbox = key, outbox
        self._received: list[int] = []
        self._finished, self._name = finished, name

    @property
    def tokens(self) -> list[int]:
        return list(self._received)

    @property
    def text(self) -> None:
        return None

    def _push(self, delta: Delta) -> None:
        self._received += delta.tokens
        self.outbox.put((self.key, delta.tokens, delta.finish))

    def _complete(self, completion) -> None:
        super()._complete(completion)
        self._forget()

    def _fail(self, error: BaseException) -> None:
        self.outbox.fail(self.key, wire.WireError.of(error))
        super()._fail(error)
        self._forget()

    def _forget(self) -> None:
        if self._finished is not None:
            self._finished.append(self._name)  # deque.append: safe from any thread


class Front:
    """One HTTP front's end of the pipes: its connection, what waits to be sent to it, its sender thread.

    ``flush`` sends what the outbox holds on the calling thread when the socket takes it without waiting
    (``MSG_DONTWAIT``): woken per burst, the senders took ~180 µs of CPU per request at 64 streams against the
    serving thread's ~530 (benchmarks/pipe_cost.py), every wake-up a hand-off of its GIL. What the socket
    does not take at once, and everything after it, goes to the sender thread, which sends it blocking: a
    front that does not read holds up its own deliveries only, never the serving loop. Both send under
    ``lock``, so messages leave in the order they were taken."""

    def __init__(self, index: int, conn) -> None:
        self.index, self.conn = index, conn
        self.outbox = Outbox()
        self.lock = threading.Lock()
        self.sender = threading.Thread(target=self._send_deliveries, name=f"dflash-trt-deliveries-{index}", daemon=True)
        self.socket = _socket_of(conn)  # None: no socket under the connection, every message goes through the sender

    def send(self, message) -> None:
        """``message`` to the front, waiting while its socket is full (``Ready``; the sender thread's sends)."""
        with self.lock:
            self.conn.send(message)

    def send_now(self, message) -> bytes | None:
        """``message`` to the front if its socket takes it without waiting (the caller holds ``lock``, nothing is
        behind): the end it did not take (b"": all of it), or None when it took none."""
        data = _framed(message)
        if data is None:
            return None
        try:
            sent = self.socket.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        return data[sent:]

    def flush(self) -> None:
        """What the outbox holds: sent now as far as the socket takes it without waiting, the rest by the sender."""
        outbox = self.outbox
        if not outbox.pending:
            return
        if self.socket is None or not self.lock.acquire(blocking=False):  # another thread sends: the sender takes these
            outbox.wake()
            return
        try:
            if outbox.behind:
                outbox.wake()
                return
            messages = outbox.take()[1]
            for i, message in enumerate(messages):
                rest = self.send_now(message)
                if rest is None:
                    outbox.defer(messages[i:])
                    return
                if rest:  # the socket took part of it: its end and what follows are the sender's
                    outbox.defer(messages[i + 1 :], rest)
                    return
        except OSError:  # the front is gone: the main thread sees EOF and drops it
            return
        finally:
            self.lock.release()

    def close(self, timeout: float) -> None:
        """The outbox closed; the sender sends what it holds (up to ``timeout`` s) and ends; the socket closed."""
        self.outbox.close()
        if self.sender.is_alive():
            self.sender.join(timeout)
        if self.socket is not None:
            self.socket.close()

    def _send_deliveries(self) -> None:
        while self.outbox.wait():
            with self.lock:
                rest, messages = self.outbox.take()
                try:
                    if rest:
                        self.socket.sendall(rest)
                    for message in messages:
                        self.conn.send(message)
                except (OSError, ValueError):  # the front is gone: the main thread sees EOF and drops it
                    return


def _receive(conn):
    """The next message on ``conn``, or an ``EOFError`` (not raised) once its other end is gone."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return EOFError()


def _socket_of(conn) -> socket.socket | None:
    """A socket over a duplicate of ``conn``'s descriptor (a duplex ``multiprocessing.Pipe`` on POSIX is a socket
    pair), for sends that never wait; None where there is none (the sender thread then sends everything)."""
    try:
        return socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, AttributeError, ValueError):
        return None


DIRECT_BYTES = 1 << 20  # a larger message goes through the sender (``Connection.send``'s framing for it differs)


def _framed(message) -> bytes | None:
    """``message`` as ``multiprocessing.Connection.send`` writes it (a 4-byte big-endian length, then the
    pickle), so the front's ``recv`` reads it; None past ``DIRECT_BYTES``."""
    data = ForkingPickler.dumps(message)
    return struct.pack("!i", len(data)) + bytes(data) if len(data) <= DIRECT_BYTES else None


class ServingProcess:
    """The main thread's side of the pipes over one loaded ``ServingLoop`` (see the module docstring).

    ``conns``: one connection per HTTP front (``serve --fronts N``); the first front owns the process
    (its ``Exit`` or its end of the pipe closing ends it), another front's end closing cancels that
    front's requests only. A request is known by (front index, the front's key)."""

    def __init__(self, conns) -> None:
        self.fronts = [Front(i, conn) for i, conn in enumerate(conns)]
        self.serving = None
        self.handles: dict[tuple[int, int], ForwardingHandle] = {}  # the reading thread's alone (``_reader``)
        self._finished: deque[tuple[int, int]] = deque()  # handles' names as they finish (any thread appends)
        self._submitting: tuple[int, int] | None = None  # the (front, key) ``handle`` names (one submit at a time)
        self._dispatch = {wire.Submit: self._submit, wire.Cancel: self._cancel, wire.Close: self._close, wire.MetricsQuery: self._metrics}
        self._selector: selectors.BaseSelector | None = None  # the pipes (``run``), read by ``_reader`` alone
        self._turn = threading.Condition()  # guards the two below
        self._reader = MAIN  # who reads the pipes: the main thread (the loop idle) or the loop's thread (at its flushes)
        self._control: list[tuple[object, int]] = []  # what the loop's thread read that the main thread must handle

    def flush(self) -> None:
        """``ServingLoop(flush=...)``, on the loop's thread after each burst of deliveries: while the loop is busy it
        reads the pipes here (the main thread then waits, so no message wakes it, each wake-up a hand-off of the
        loop's GIL); every front's deliveries go out; once the loop is idle the main thread reads again."""
        if self._reader == LOOP:
            self._read_here()
        for front in self.fronts:
            front.flush()
        if self._reader == LOOP and self.serving.idle:
            self._hand_to(MAIN)

    def _read_here(self) -> None:
        """The loop's thread: the messages waiting in the pipes (``READ_AT_MOST`` rounds of one a pipe), handled as
        the main thread would; one only the main thread may handle (``Exit``, ``Close``, a pipe's end) goes to it,
        with the reading."""
        for _ in range(READ_AT_MOST):
            ready_conns = self._selector.select(0)
            if not ready_conns:
                return
            for key, _ in ready_conns:
                message = _receive(key.fileobj)
                if isinstance(message, (EOFError, wire.Exit, wire.Close)):
                    self._hand_to(MAIN, (message, key.data))
                    return
                self._dispatch[type(message)](message, key.data)

    def _hand_to(self, reader: str, control: tuple[object, int] | None = None) -> None:
        """The pipes' reading to ``reader``; ``control``: a message the loop's thread read for the main thread."""
        with self._turn:
            if control is not None:
                self._control.append(control)
            self._reader = reader
            self._turn.notify()

    def handle(self, request_id: int, prompt: list[int], cancel) -> ForwardingHandle:
        """``ServingLoop(handles=...)``: the handle of the request being submitted, made once the loop took it (under
        its lock, before its thread can see the request). Its acceptance goes to the outbox here, ahead of any of its
        tokens, so the loop's first flush after it carries it: were it put after ``submit`` returned, a request the
        loop ran to its end meanwhile would leave it unsent, and its front waiting for the answer."""
        index, key = self._submitting
        handle = ForwardingHandle(self.fronts[index].outbox, key, request_id, prompt, cancel, self._finished, (index, key))
        self.handles[(index, key)] = handle
        self.fronts[index].outbox.accept(key)
        return handle

    def run(self, serving, ready: wire.Ready) -> int:
        """Serve the pipes until Exit (0), the first front's end closing (0) or the serving loop failing (1).

        The main thread reads the pipes while the loop is idle; once a message leaves it busy, the loop's thread
        reads them at its flushes (``flush``) until it is idle again, and this thread waits meanwhile."""
        self.serving = serving
        for front in self.fronts:
            front.sender.start()
            front.send(ready)
        # One selector for the process's life (``multiprocessing.connection.wait`` builds and fills a new one per
        # call: ~10 µs of Python per message here, on the serving loop's GIL).
        with selectors.DefaultSelector() as selector:
            for front in self.fronts:
                selector.register(front.conn, selectors.EVENT_READ, front.index)
            self._selector = selector
            while True:
                with self._turn:
                    if self._reader == LOOP:
                        self._turn.wait(POLL_S)
                    control, mine = list(self._control), self._reader == MAIN
                    self._control.clear()
                for message, index in control:  # read by the loop's thread, handed here with the reading
                    if (code := self._handle(message, index)) is not None:
                        return code
                ready_conns = selector.select(POLL_S) if mine else []  # not ours: the turn's wait was the poll
                if not ready_conns and not serving.healthy:
                    log.error("the serving loop stopped after an internal error; the serving process exits")
                    return 1
                for key, _ in ready_conns:
                    if (code := self._handle(_receive(key.fileobj), key.data)) is not None:
                        return code
                if not mine:
                    continue
                with self._turn:  # under the turn: the loop's thread hands the reading back only at a flush after this
                    if not serving.idle:
                        self._reader = LOOP

    def _handle(self, message, index: int) -> int | None:
        """The main thread: one message of front ``index`` (``EOFError``: its pipe's end); the exit code when it ends the process."""
        if isinstance(message, EOFError):
            if index == 0:
                log.info("the front closed the pipe; the serving process stops")
                return 0
            self._selector.unregister(self.fronts[index].conn)
            self._front_gone(index)
            return None
        if isinstance(message, wire.Exit):
            return 0
        self._dispatch[type(message)](message, index)
        # Read while the loop was idle: the answer goes out at once (a submit's acceptance ahead of its first tokens,
        # so the front starts its response meanwhile); the loop's thread answers what it reads at its flush.
        self.fronts[index].flush()
        return None

    def stop(self) -> bool:
        """Cancel what is left, stop the loop and the senders; True when the loop's thread ended."""
        stopped = self.serving.close(drain=False, timeout=EXIT_JOIN_S) if self.serving is not None else True
        for front in self.fronts:
            front.close(EXIT_JOIN_S)
        return stopped

    def _front_gone(self, index: int) -> None:
        """Front ``index`` closed its pipe (its process ended): its open requests are cancelled."""
        orphans = [self.handles.pop(k) for k in [k for k in self.handles if k[0] == index]]
        open_ = [handle for handle in orphans if not handle.done]
        (log.warning if open_ else log.info)("HTTP front %d closed its pipe; %d of its requests were open and are cancelled", index, len(open_))
        for handle in open_:
            handle.cancel(CANCELLED)
        self.fronts[index].outbox.close()

    def _submit(self, message: wire.Submit, front: int) -> None:
        self._forget_finished()
        self._submitting = (front, message.key)
        try:
            self.serving.submit(message.prompt, message.max_new_tokens, sampling=message.sampling, stop_ids=message.stop_ids)
        except DFlashError as error:
            self.fronts[front].outbox.answer(wire.Refused(message.key, wire.WireError.of(error)))
            self.fronts[front].flush()
        # Accepted: ``handle`` put the answer; the reading thread's flush sends it.

    def _cancel(self, message: wire.Cancel, front: int) -> None:
        handle = self.handles.pop((front, message.key), None)
        if handle is not None:
            handle.cancel(message.finish)

    def _close(self, message: wire.Close, front: int) -> None:
        self.serving.close(drain=message.drain, timeout=0)

    def _metrics(self, message: wire.MetricsQuery, front: int) -> None:
        self.fronts[front].outbox.answer(wire.MetricsReply(message.seq, self.serving.metrics()))

    def _forget_finished(self) -> None:
        """Drop the handles of finished requests (bounded: done at every submit, so the map holds at
        most the open requests plus those finished since the last submit). Each finished handle names
        itself once (``ForwardingHandle._forget``): the work is per finished request, not a scan of every
        open one per submit (at 128 open requests and ~900 submits a second, ~10^5 checks a second on the
        serving process's GIL)."""
        finished = self._finished
        while finished:
            self.handles.pop(finished.popleft(), None)  # a cancel may have dropped it already


def main(conns, args, logging_config: dict) -> None:
    """The process's entry (``multiprocessing``, spawn): load, answer ``Ready`` to every front, serve the
    pipes, exit. ``conns``: one connection per HTTP front, the first the owning front's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.config.dictConfig(logging_config)
    from dflash_trt.server import command

    command.cap_malloc_arenas()
    process = ServingProcess(conns)
    try:
        serving, backend, _ = command._load(args, text=False, handles=process.handle, flush=process.flush)
    except BaseException as error:  # noqa: BLE001  (reported to the front, which raises it)
        if not isinstance(error, DFlashError):
            log.exception("the serving process failed while loading")
        for conn in conns:
            _send_quietly(conn, wire.LoadFailed(wire.WireError.of(error)))
        _exit(1)
    command.freeze_heap()
    executor = serving.executor
    ready = wire.Ready(executor.speculate, executor.max_sessions, executor.dims.max_context, executor.dims.vocab_size,
                       None if args.artifacts is None else str(args.artifacts), os.getpid())
    code = 1
    try:
        code = process.run(serving, ready)
    finally:
        if process.stop():
            backend.close()
        _exit(code)


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the front's process dies (it may die while this one loads)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown of torch / onnxruntime state (the front waits on this exit)."""
    logging.shutdown()
    os._exit(code)


__all__ = ["CANCELLED", "ForwardingHandle", "Outbox", "ServingProcess", "main"]
