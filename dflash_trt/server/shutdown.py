"""Graceful shutdown: on SIGINT / SIGTERM nothing accepted is lost, and the process exits 0 in bounded time.

    signal ──> draining: /health and new requests answer 503; the serving loop accepts nothing new
           ──> open requests finish normally, until --shutdown-timeout
           ──> aborted: each open stream ends with finish_reason "abort" and [DONE], each open
               non-stream request gets a 503; the serving loop cancels what it still runs
           ──> uvicorn closes the listener and the connections; the process exits 0

A second SIGINT skips the wait (the open requests are aborted at once).
When the serving process dies (``--front-process``), its open requests have
already failed (503 / a last error event); /health answers 503 for
``DEATH_GRACE_S``, then the server stops (and ``dflash-trt serve`` exits 1).
``Shutdown`` holds the states the routes read and the count of open API
requests, kept by ``InFlight`` (an ASGI middleware: a request is open until
its response, streamed or not, has been sent); ``GracefulServer`` is
uvicorn's server with this drain in place of its own signal handling (which
cancels handlers mid-stream when its timeout passes, and re-raises the
signal after).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

log = logging.getLogger("dflash_trt.server")

POLL_S = 0.02  # how often the drain looks at the open requests
ABORT_GRACE_S = 0.5  # after the abort: time for the aborted responses to be sent
CLOSE_GRACE_S = 0.3  # then uvicorn's own graceful timeout for the connections left
DEATH_GRACE_S = 2.0  # after the serving process died: /health says so (503) this long, then the server stops


class Shutdown:
    """The shutdown states the routes read (set on the event loop's thread)."""

    def __init__(self) -> None:
        self.draining = False  # refuse new requests (503)
        self.open = 0  # API requests whose response is not yet sent (``InFlight``)
        self._aborted: asyncio.Future | None = None

    @property
    def aborted(self) -> asyncio.Future:
        """Done once the deadline passed: every open request ends now. One future for all requests
        (made on first use, on the event loop), so waiting on it costs no task per request."""
        if self._aborted is None:
            self._aborted = asyncio.get_running_loop().create_future()
        return self._aborted

    def abort(self) -> None:
        if not self.aborted.done():
            self.aborted.set_result(None)


class InFlight:
    """ASGI middleware counting the open requests under ``/v1/`` (the routes that run the model)."""

    def __init__(self, app, shutdown: Shutdown) -> None:
        self.app, self.shutdown = app, shutdown

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.shutdown.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.shutdown.open -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server that drains on SIGINT / SIGTERM (see the module docstring).

    ``serving`` is the ``ServingLoop`` (closed to new requests at the signal,
    cancelled at the deadline), ``shutdown`` the app's ``Shutdown``,
    ``deadline_s`` --shutdown-timeout.
    """

    def __init__(self, config: uvicorn.Config, serving, shutdown: Shutdown, deadline_s: float) -> None:
        config.timeout_graceful_shutdown = CLOSE_GRACE_S
        super().__init__(config)
        self.serving, self.shutdown_state, self.deadline_s = serving, shutdown, deadline_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_signal = None  # called with every shutdown signal (the other HTTP fronts get it too)
        self.signalled = False
        self.hurry = False
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal (main thread): start the drain; a second SIGINT (Ctrl+C again) skips its wait (a
        repeated SIGTERM does not: ``timeout`` and process managers deliver it to the whole group).
        Not re-raised after."""
        if self.on_signal is not None:
            self.on_signal(sig)
        if self.signalled:
            self.hurry = self.hurry or sig == signal.SIGINT
            return
        self.signalled = True
        if self.loop is None or not self.started:
            self.should_exit = True  # before the server runs: nothing to drain
            return
        self.loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def serving_died(self) -> None:
        """The serving process died (any thread): stop after ``DEATH_GRACE_S`` (its requests already failed)."""
        if self.loop is None:
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._stop_later)

    def _stop_later(self) -> None:
        self.loop.call_later(DEATH_GRACE_S, setattr, self, "should_exit", True)

    def _start_drain(self, name: str) -> None:
        self._drain = self.loop.create_task(self.drain(name))

    async def drain(self, name: str) -> None:
        """Refuse new requests, let the open ones finish until the deadline, abort the rest, stop."""
        state, loop = self.shutdown_state, asyncio.get_running_loop()
        state.draining = True
        self.serving.close(drain=True, timeout=0)
        log.info("%s: shutting down; %d open requests get up to %.1f s to finish (--shutdown-timeout), new ones get 503",
                 name, state.open, self.deadline_s)
        deadline = loop.time() + self.deadline_s
        while state.open and loop.time() < deadline and not self.hurry:
            await asyncio.sleep(POLL_S)
        if state.open:
            log.warning("shutdown deadline: aborting %d open requests (streams end with finish_reason abort)", state.open)
            state.abort()
            self.serving.close(drain=False, timeout=0)
            grace = loop.time() + ABORT_GRACE_S
            while state.open and loop.time() < grace:
                await asyncio.sleep(POLL_S)
        self.should_exit = True
