"""The server's child processes, asked from several threads: whether one ended, and its exit code.

``multiprocessing.Process.is_alive`` and ``join`` reap the child (``waitpid``). When two threads do that for
one child, the loser's call fails (ECHILD), and ``multiprocessing`` reports a child that has exited as
still running (``is_alive()`` True, ``exitcode`` None): at shutdown the server logged clean exits of its
serving process and fronts as hangs ("did not exit ...; killing it") and killed processes that were gone. Here a child's end is read from its
sentinel, which reaps nothing, and reaping goes through one lock.
"""

from __future__ import annotations

import multiprocessing.connection
import threading

_REAPING = threading.Lock()  # one ``waitpid`` of a child at a time (``exit_code``)


def ended(process, timeout: float = 0.0) -> bool:
    """Whether ``process`` (a ``multiprocessing`` child) has ended, waiting up to ``timeout`` seconds (its
    sentinel: nothing is reaped)."""
    return bool(multiprocessing.connection.wait([process.sentinel], timeout))


def exit_code(process) -> int | None:
    """An ended process's exit code (blocks until it ends): reaped under one lock, so any thread may ask."""
    with _REAPING:
        process.join()
    return process.exitcode


__all__ = ["ended", "exit_code"]
