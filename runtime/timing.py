"""Device time, on both clocks: CUDA events on the backend's stream, or host time around synchronous work (CPU).

- ``HostClock`` / ``EventClock`` (``make_clock``): the executor's marks around
  target work (prefill, the choice after it);
- ``Timeline``: the device loop's launches, their device busy time and the
  device's idle gaps between consecutive launches.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_trt.runtime.backends.base import Backend
    from dflash_trt.runtime.device_loop import Launch


class HostClock:
    """Device time as host time around backend calls: right where ``run`` returns finished work (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1000.0

    def release(self, *marks) -> None:
        pass


class EventClock:
    """Device time from CUDA events on the backend's stream (read after the cycle's host sync)."""

    def __init__(self, stream) -> None:
        from dflash_trt.runtime import device

        self.stream, self.device = stream, device

    def mark(self):
        event = self.device.Event(timing=True)
        event.record(self.stream)
        return event

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()  # host sync: the cycle already waited on its verdict, so this is free
        return start.elapsed_ms(end)

    def release(self, *marks) -> None:
        for event in marks:
            event.close()


def make_clock(backend: Backend):
    """Events on the backend's device-layer stream when it has one (CUDA), host time otherwise."""
    if backend.device.type == "cuda" and backend.stream is not None:
        return EventClock(backend.stream.device_stream)
    return HostClock()


class Timeline:
    """Device busy time of launches and the device's idle gaps between consecutive ones.

    CUDA: events recorded around every launch on the backend's stream (taken from
    a pool, returned once read). CPU: host time around the synchronous launch.
    """

    def __init__(self, stream) -> None:
        self.stream = stream  # device-layer Stream, None on CPU
        self.free: list = []
        self.previous_end = None
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self.launches = 0

    def mark(self):
        if self.stream is None:
            return time.perf_counter()
        if not self.free:
            from dflash_trt.runtime.device import Event

            self.free.append(Event(timing=True))
        event = self.free.pop()
        event.record(self.stream)
        return event

    def wait(self, launch: Launch) -> None:
        """Host sync: until the launch has finished on the device."""
        if self.stream is not None:
            launch.ended.synchronize()

    def account(self, launch: Launch) -> float:
        """The launch's device ms (call after ``wait``); adds the gap since the previous launch ended."""
        if self.stream is None:
            device_ms = (launch.ended - launch.started) * 1000.0
            gap_ms = 0.0
        else:
            device_ms = launch.started.elapsed_ms(launch.ended)
            gap_ms = self.previous_end.elapsed_ms(launch.started) if self.previous_end is not None else 0.0
            if self.previous_end is not None:
                self.free.append(self.previous_end)
            self.free.append(launch.started)
        self.previous_end = launch.ended if self.stream is not None else None
        self.busy_ms += device_ms
        self.idle_ms += max(0.0, gap_ms)
        self.launches += 1
        return device_ms

    def reset(self) -> None:
        """Zero the totals (e.g. after a warm-up)."""
        self.busy_ms = self.idle_ms = 0.0
        self.launches = 0

    def end_run(self) -> None:
        """Between executes the host works: gaps are counted only within one run of launches."""
        if self.previous_end is not None:
            self.free.append(self.previous_end)
        self.previous_end = None

    def close(self) -> None:
        self.end_run()
        for event in self.free:
            event.close()
        self.free.clear()
