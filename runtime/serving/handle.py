"""A request's handle: a blocking iterator, an async iterator and a future, fed by the serving loop.

The loop thread calls ``_push`` / ``_complete`` / ``_fail``; any number of
consumers read, each with its own cursor:

    for delta in handle: ...            # blocks between deliveries
    async for delta in handle: ...      # awaits (asyncio), wakes through call_soon_threadsafe
    async for delta in handle.deltas(until=future): ...   # ... or stops once ``future`` is done
    completion = handle.result()        # or: await handle, or handle.future

A failed request raises its error from all three (after the deltas that
arrived before the failure). ``cancel()`` ends it with finish "cancelled"
and the tokens delivered so far.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from dflash_trt.runtime.finish import CANCELLED


@dataclass
class Completion:
    """A request's end: every token it produced, why it ended, and its text (None without a tokenizer)."""

    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class Delta:
    """Tokens of one delivery; ``text`` their final text (None without a tokenizer); ``finish`` on the last."""

    tokens: list[int]
    text: str | None
    finish: str | None = None


class RequestHandle:
    """One submitted request (``ServingLoop.submit``): see the module docstring."""

    def __init__(self, request_id: int, prompt: list[int], cancel: Callable[[RequestHandle], None]) -> None:
        self.id = request_id
        self.prompt = prompt  # token ids, as served
        self.future: Future[Completion] = Future()
        self._cancel = cancel
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._done = False
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ consumers

    @property
    def done(self) -> bool:
        return self._done

    @property
    def tokens(self) -> list[int]:
        """Every token delivered so far."""
        with self._cond:
            return [t for d in self._deltas for t in d.tokens]

    @property
    def text(self) -> str | None:
        with self._cond:
            parts = [d.text for d in self._deltas if d.text is not None]
            return "".join(parts) if parts or not self._deltas else None

    def cancel(self, finish: str = CANCELLED) -> None:
        """Stop generating (no-op once finished); the result keeps the tokens delivered so far. ``finish``:
        the reason it ends with (STOP when the caller found a stop string in the text it decodes itself)."""
        if not self._done:
            self._cancel(self, finish)

    def result(self, timeout: float | None = None) -> Completion:
        """Block for the whole completion; raises the request's error if it failed."""
        return self.future.result(timeout)

    def __await__(self):
        # Shielded: a cancelled awaiter must not cancel the shared future (the loop completes it later).
        return asyncio.shield(asyncio.wrap_future(self.future)).__await__()

    def __iter__(self) -> Iterator[Delta]:
        cursor = 0
        while True:
            with self._cond:
                while cursor == len(self._deltas) and not self._done:
                    self._cond.wait()
                ready, done, error = self._deltas[cursor:], self._done, self._error
            cursor += len(ready)
            yield from ready
            if done and cursor == len(self._deltas):
                if error is not None:
                    raise error
                return

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self.deltas()

    async def deltas(self, until: asyncio.Future | None = None) -> AsyncIterator[Delta]:
        """The deltas as they arrive (``async for delta in handle``); with ``until``, the iteration also
        stops, without the rest, once that future is done (a server's shutdown deadline)."""
        cursor = 0
        while True:
            waiter = None
            with self._cond:
                ready, done, error = self._deltas[cursor:], self._done, self._error
                if not ready and not done:
                    loop = asyncio.get_running_loop()
                    waiter = loop.create_future()
                    self._waiters.append((loop, waiter))
            cursor += len(ready)
            for delta in ready:
                yield delta
            if waiter is not None:
                await (waiter if until is None else asyncio.wait((waiter, until), return_when=asyncio.FIRST_COMPLETED))
                if until is not None and until.done():
                    return
            elif done and not ready:
                if error is not None:
                    raise error
                return

    # ------------------------------------------------------------------ the serving loop

    def _push(self, delta: Delta) -> None:
        with self._cond:
            self._deltas.append(delta)
            self._wake()

    def _complete(self, completion: Completion) -> None:
        with self._cond:
            self._done = True
            self._wake()
        self.future.set_result(completion)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._done, self._error = True, error
            self._wake()
        self.future.set_exception(error)

    def _wake(self) -> None:
        """Under ``_cond``: wake blocking readers and every waiting coroutine (in its own loop)."""
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                pass


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
