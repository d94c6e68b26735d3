"""More HTTP fronts: ``serve --fronts N`` runs N − 1 front processes beside this one, all accepting on
the one listening socket, each with a pipe of its own to the serving process.

One front (FastAPI + uvicorn: parsing, tokenizing, detokenizing, SSE) spends about a millisecond of CPU
per request and tens of microseconds per streamed event (``benchmarks/front_cost.py``), so at a few
hundred requests and ~10,000 stream events per second one front process is busy all the time while
the serving process is not, and requests wait in its event loop. The kernel hands each new connection
to one of the processes accepting on the socket; each front runs the same app over its own
``ServingClient`` (``server.front``).

This process (the first front) owns the others: it spawns them once the serving process has loaded,
and every front starts accepting at once (a barrier just before each one's accept loop): connections
made while the others still start would all stay with the first front (clients keep them open), so
the server is ready only when every front is. It forwards SIGINT / SIGTERM to them (each drains its
own streams as the first does; a signal sent to the whole process group reaches them directly too, and
a repeated SIGTERM changes nothing), waits for them before it stops the serving process, and logs one
that ends early (the others keep serving; the serving process cancelled its requests when its pipe
closed). They die with this process (Linux ``PR_SET_PDEATHSIG``). The throughput log line is the first
front's; every front logs its access lines.
"""

from __future__ import annotations

import argparse
import logging
import logging.config
import multiprocessing
import multiprocessing.connection
import os
import threading
import time

from dflash_trt.server.children import ended, exit_code

log = logging.getLogger("dflash_trt.server")

STOP_GRACE_S = 3.0  # after the drain deadline: how long an extra front gets to exit before it is killed
START_TIMEOUT_S = 120.0  # how long the fronts wait for each other before accepting (then those started serve)


class Fronts:
    """The extra front processes of one server (see the module docstring)."""

    def __init__(self, conns: list, listener, args: argparse.Namespace, logging_config: dict) -> None:
        """``conns``: the serving process's pipes of the extra fronts (fronts 1..N-1)."""
        from dflash_trt.server.front import child_args

        context = multiprocessing.get_context("spawn")
        self.stopping = False
        self.processes = []
        self.started = context.Barrier(len(conns) + 1)  # every front, this one included, before it accepts
        for index, conn in enumerate(conns, start=1):
            process = context.Process(target=main, args=(index, conn, listener, child_args(args), logging_config, self.started),
                                      name=f"dflash-trt-front-{index}")
            process.start()
            conn.close()  # the child holds it now
            self.processes.append(process)
        self._watcher = threading.Thread(target=self._watch, name="dflash-trt-fronts", daemon=True)
        self._watcher.start()

    def start_together(self) -> None:
        """This front's wait for the others to reach their accept loops (see the module docstring). Once
        every front has passed it the barrier is dropped: that unlinks its named semaphores, which this
        process's exit (``os._exit``, no finalizers) would leave to the resource tracker ("leaked
        semaphore objects" at every shutdown). One that broke is kept: a late front still opens it."""
        if accept_together(self.started, 0):
            self.started = None

    def signal(self, sig: int) -> None:
        """Forward a shutdown signal to every extra front (it drains as this one does)."""
        self.stopping = True
        for process in self.processes:
            if not ended(process):
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:  # it ended meanwhile
                    pass

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for every extra front to exit (after ``signal``), then kill the rest."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for process in self.processes:
            if not ended(process, max(0.0, deadline - time.monotonic())):
                log.warning("HTTP front %s did not exit in time; killing it", process.name)
                process.kill()
            exit_code(process)

    def _watch(self) -> None:
        """Log a front that ends while the server is not stopping."""
        waiting = list(self.processes)
        while waiting:
            ready = multiprocessing.connection.wait([p.sentinel for p in waiting])
            for process in [p for p in waiting if p.sentinel in ready]:
                waiting.remove(process)
                started = self.started
                if started is not None:
                    started.abort()  # a front that died starting: the others do not wait for it
                if not self.stopping:
                    log.error("HTTP front %s (pid %d) exited with code %s; %d fronts keep serving", process.name, process.pid,
                              exit_code(process), 1 + sum(not ended(p) for p in self.processes))


def accept_together(started, index: int) -> bool:
    """Front ``index`` waits for every front at ``started`` (a barrier) before it accepts connections; one
    that did not start in time (or died) is logged and the others serve without it. True when every
    front passed it."""
    try:
        started.wait(START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        if index == 0:
            log.warning("not every HTTP front started within %.0f s; those that did serve", START_TIMEOUT_S)
        return False
    return True


def main(index: int, conn, listener, args: argparse.Namespace, logging_config: dict, started) -> None:
    """An extra front's process (``multiprocessing``, spawn): the app over its pipe, on the shared socket."""
    from dflash_trt.server import command, serving_process
    from dflash_trt.server.front import ServingClient

    serving_process._die_with_parent()
    logging.config.dictConfig(logging_config)
    ready = conn.recv()
    if not hasattr(ready, "pid"):  # LoadFailed: the first front reports it
        os._exit(1)
    client = ServingClient(None, conn, ready, command._tokenizer(args))
    log.info("HTTP front %d (pid %d) serving", index, os.getpid())
    died = command.serve_http(client, args.served_model_name or [command._model_name(args)], args, logging_config, listener,
                              log_interval_s=0, prepare=lambda server: accept_together(started, index))
    client.stop()
    logging.shutdown()
    os._exit(1 if died else 0)


__all__ = ["Fronts", "main"]
