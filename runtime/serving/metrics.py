"""Serving metrics of the serving loop: request counters, latency windows, one snapshot.

Latencies are seconds, measured on the host clock where a client would see
them (the serving loop's handle receives the tokens):

| name | from | to |
| --- | --- | --- |
| queue wait | ``submit`` | the request joins a batch (its session opens) |
| time to first token (TTFT) | ``submit`` | its first tokens reach the handle |
| inter-token latency (ITL) | one delivery of tokens | the next delivery of the same request |

A DFlash cycle delivers its accepted tokens together, so ITL is the gap
between deliveries, as a streaming client observes it (not divided by the
tokens in the delivery). Percentiles are over a bounded window of the most
recent samples; counters are totals since the serving loop started. τ comes from
the executor's own per-execute counters (``runtime.stats``): 1 + accepted /
owner-cycles, the bonus token included.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

WINDOW_SAMPLES = 4096  # latency samples kept per kind
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window
QUANTILES = (0.5, 0.9, 0.99)
OUTCOMES = ("completed", "cancelled", "failed", "rejected")


@dataclass(frozen=True)
class Percentiles:
    """Seconds; None before the first sample."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None


@dataclass(frozen=True)
class ServingMetrics:
    """One snapshot of the serving loop (``ServingLoop.metrics()``)."""

    running: int  # requests holding a session
    queued: int  # accepted, waiting for a session
    submitted: int
    completed: int  # finished by stop / length / context
    cancelled: int
    failed: int  # errored by a serving failure
    rejected: int  # refused at submit: queue full or serving closed
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float  # over the last RATE_WINDOW_S seconds
    cycles: int  # speculative owner-cycles run by the executor
    tau: float | None  # mean tokens per cycle, bonus included
    executes: int
    failed_executes: int
    uptime_s: float
    queue_wait_s: Percentiles
    ttft_s: Percentiles
    itl_s: Percentiles

    def as_dict(self) -> dict:
        return asdict(self)


def percentiles(samples) -> Percentiles:
    values = np.fromiter(samples, dtype=np.float64)
    if values.size == 0:
        return Percentiles(0, None, None, None, None)
    p50, p90, p99 = (float(q) for q in np.quantile(values, QUANTILES))
    return Percentiles(int(values.size), p50, p90, p99, float(values.mean()))


class MetricsRecorder:
    """Thread-safe accumulators; the serving loop records, any thread snapshots."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.perf_counter()
        self.counts = dict.fromkeys(("submitted", *OUTCOMES, "prompt_tokens", "output_tokens"), 0)
        self.executor_totals = dict.fromkeys(("cycles", "accepted", "executes", "failed_executes"), 0)
        self.queue_wait: deque[float] = deque(maxlen=WINDOW_SAMPLES)
        self.ttft: deque[float] = deque(maxlen=WINDOW_SAMPLES)
        self.itl: deque[float] = deque(maxlen=WINDOW_SAMPLES)
        self.deliveries: deque[tuple[float, int]] = deque()  # (time, tokens) within RATE_WINDOW_S

    def count(self, name: str, value: int = 1) -> None:
        with self.lock:
            self.counts[name] += value

    def joined(self, waited_s: float) -> None:
        with self.lock:
            self.queue_wait.append(waited_s)

    def delivered(self, now: float, tokens: int, ttft_s: float | None, gap_s: float | None) -> None:
        with self.lock:
            self.counts["output_tokens"] += tokens
            self.deliveries.append((now, tokens))
            if ttft_s is not None:
                self.ttft.append(ttft_s)
            if gap_s is not None:
                self.itl.append(gap_s)

    def executed(self, cycles: int, accepted: int, executes: int, failed: int) -> None:
        with self.lock:
            totals = self.executor_totals
            totals["cycles"] += cycles
            totals["accepted"] += accepted
            totals["executes"] += executes
            totals["failed_executes"] += failed

    def snapshot(self, running: int, queued: int) -> ServingMetrics:
        now = time.perf_counter()
        with self.lock:
            while self.deliveries and self.deliveries[0][0] < now - RATE_WINDOW_S:
                self.deliveries.popleft()
            window = min(RATE_WINDOW_S, now - self.started)
            rate = sum(n for _, n in self.deliveries) / window if window > 0 else 0.0
            totals, counts = dict(self.executor_totals), dict(self.counts)
            waits, ttft, itl = list(self.queue_wait), list(self.ttft), list(self.itl)
        cycles = totals["cycles"]
        return ServingMetrics(
            running=running,
            queued=queued,
            **counts,
            output_tokens_per_s=rate,
            cycles=cycles,
            tau=1.0 + totals["accepted"] / cycles if cycles else None,
            executes=totals["executes"],
            failed_executes=totals["failed_executes"],
            uptime_s=now - self.started,
            queue_wait_s=percentiles(waits),
            ttft_s=percentiles(ttft),
            itl_s=percentiles(itl),
        )
