"""Who may use a backend, and when: one call at a time, each cache row to one session.

The concurrency model (README, "Threads"):

- A backend runs one executor call at a time. Its graphs share one IO
  binding / execution context and one set of output buffers per graph, and
  the executor reads those outputs after the next ``run``: two calls
  interleaved would compute garbage with no error. So every executor call
  that reads or changes sessions (``execute``, ``open_session``,
  ``close_session``, ``clone``, ``set_sampling``, ``session``, ``sessions``,
  ``close``) holds the backend's ``CallGuard``. A call that finds it held by
  another call is REFUSED at once with ``BusyError`` (nothing changed, no
  waiting): an executor is owned by one thread (a serving loop), and a
  second thread calling into it is a bug to report, not to hide behind a
  queue. Stats reads (``cycle_stats``, ``drain_stats``...) never take it.
- Cache rows belong to the backend, not to an executor: every executor over
  one backend takes its sessions' rows from the backend's one
  ``RowAllocator``, so two executors over one backend never hand out the same
  row. An executor gives its rows back when closed (or garbage-collected).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dflash_trt.errors import BusyError, SessionError


class RowAllocator:
    """Free list over ``rows`` pool rows; hands out rows that keep sessions in consecutive runs.

    A take picks the free row with most used neighbours, then the lowest (a row between two used rows joins
    two runs into one; beside one it extends a run; with none used, row 0). Kept incrementally: the free rows
    beside a used one, by how many used neighbours each has, are updated at each take and give (two
    neighbours each), so a take looks at those rows only, not at every used row (a serving loop opens a
    session per request).
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.used: set[int] = set()
        self._beside: tuple[set[int], set[int]] = (set(), set())  # free rows with one / two used neighbours

    def take(self) -> int:
        if len(self.used) >= self.rows:
            gc.collect()  # executors dropped without close() give their rows back when collected
        if len(self.used) >= self.rows:
            msg = f"every cache row of the backend is in use ({self.rows} rows); close a session first"
            raise SessionError(msg)
        one, two = self._beside
        row = min(two) if two else min(one) if one else 0  # no free row beside a used one: none is used
        one.discard(row)
        two.discard(row)
        self.used.add(row)
        for beside in (row - 1, row + 1):  # a free neighbour gains a used neighbour
            if 0 <= beside < self.rows and beside not in self.used:
                self._move(beside, +1)
        return row

    def give(self, row: int) -> None:
        if row not in self.used:
            return
        self.used.discard(row)
        count = 0
        for beside in (row - 1, row + 1):
            if beside in self.used:
                count += 1
            elif 0 <= beside < self.rows:
                self._move(beside, -1)  # a free neighbour lost a used neighbour
        if count:
            self._beside[count - 1].add(row)

    def give_all(self, rows: set[int]) -> None:
        """Return every row of ``rows`` (an executor closing, or collected without close)."""
        for row in list(rows):
            self.give(row)
        rows.clear()

    def _move(self, row: int, change: int) -> None:
        """Free ``row``'s count of used neighbours moved by ``change`` (+1 or -1)."""
        one, two = self._beside
        count = 2 if row in two else 1 if row in one else 0
        if count:
            self._beside[count - 1].discard(row)
        if count + change:
            self._beside[count + change - 1].add(row)


class CallGuard:
    """A lock that refuses instead of waiting: ``hold(call)`` raises ``BusyError`` when already held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder: tuple[str, str] | None = None  # (call, thread name) while held

    @contextmanager
    def hold(self, call: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            held_by, thread = self.holder or ("another call", "another thread")
            here = threading.current_thread().name
            msg = (
                f"{call}: refused, the backend is busy in {held_by}() on thread {thread!r} (called from {here!r}); "
                "an Executor serves one call at a time: drive it from one thread (nothing changed)"
            )
            raise BusyError(msg)
        self.holder = (call, threading.current_thread().name)
        try:
            yield
        finally:
            self.holder = None
            self._lock.release()


@dataclass
class Ownership:
    """What every executor over one backend shares: its rows and its call guard."""

    rows: RowAllocator
    guard: CallGuard


_CREATE = threading.Lock()  # two threads building the first executors of one backend at once


def ownership_of(backend, rows: int) -> Ownership:
    """The backend's ``Ownership``, created on first use with ``rows`` rows (the backend's pool rows)."""
    with _CREATE:
        found = getattr(backend, "_ownership", None)
        if found is None:
            found = Ownership(RowAllocator(rows), CallGuard())
            backend._ownership = found
        return found
