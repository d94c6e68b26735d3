"""Serving metrics of the serving loop: request counters, latency histograms and windows, one snapshot.

Latencies are seconds, measured on the host clock where a client would see
them (the serving loop's handle receives the tokens):

| name | from | to |
| --- | --- | --- |
| queue wait | ``submit`` | the request joins a batch (its session opens) |
| time to first token (TTFT) | ``submit`` | its first tokens reach the handle |
| inter-token latency (ITL) | one delivery of tokens | the next delivery of the same request |
| request latency (e2e) | ``submit`` | the request finishes (stop, length, context or cancel) |

A DFlash cycle delivers its accepted tokens together, so ITL is the gap
between deliveries, as a streaming client observes it (not divided by the
tokens in the delivery). Each latency feeds a cumulative histogram over fixed
buckets (``LATENCY_BUCKETS_S``, what Prometheus scrapes) and a window of
recent samples for percentiles (at most ``WINDOW_SAMPLES``, none older than
``WINDOW_S``). Counters are totals since the serving loop started. τ comes
from the executor's own per-execute counters (``runtime.stats``): 1 +
accepted / owner-cycles, the bonus token included.

Memory is bounded whether or not anyone reads the metrics: every window is
trimmed by count and by age as samples arrive, histograms are fixed arrays,
and deliveries for tokens/s are summed into ``RATE_BUCKET_S`` buckets.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from dataclasses import asdict, dataclass, field, fields

import numpy as np

WINDOW_SAMPLES = 4096  # latency samples kept per kind for percentiles ...
WINDOW_S = 300.0  # ... and none older than this
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window
RATE_BUCKET_S = 0.1  # deliveries within one bucket are summed (at most RATE_WINDOW_S / RATE_BUCKET_S + 1 kept)
QUANTILES = (0.5, 0.9, 0.99)
OUTCOMES = ("completed", "cancelled", "failed", "rejected")
LATENCIES = ("queue_wait_s", "ttft_s", "itl_s", "e2e_s")
# Upper bounds (le) of the latency histograms' buckets: 0.5 ms (a GPU's delivery gap) to 43 min; steps of
# at most ~33% between 5 ms and 5 s (where stream gaps, first tokens and short requests lie), so a p99 read
# from the buckets (``histogram_quantile``) lands within ~10-15% of the samples' own.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.006, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
                     0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5, 2.0,
                     2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(frozen=True)
class Percentiles:
    """Seconds; None before the first sample."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None


@dataclass(frozen=True)
class Histogram:
    """A latency histogram over fixed buckets: ``counts[i]`` samples in (``bounds[i-1]``, ``bounds[i]``],
    the last count above every bound; their ``sum`` (seconds) and ``count``."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, samples <= le) per bucket, ``+Inf`` last: Prometheus' buckets."""
        totals = np.cumsum(self.counts).tolist()
        return [*zip((repr(b) for b in self.bounds), totals[:-1]), ("+Inf", totals[-1])]


class _Latency:
    """One latency kind: a fixed histogram and a window bounded by count and age."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum = 0.0
        self.window: deque[tuple[float, float]] = deque(maxlen=WINDOW_SAMPLES)  # (time, seconds)

    def observe(self, now: float, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum += seconds
        self.window.append((now, seconds))
        _expire(self.window, now - WINDOW_S)

    def histogram(self) -> Histogram:
        return Histogram(LATENCY_BUCKETS_S, tuple(self.counts), self.sum, sum(self.counts))

    def recent(self, now: float) -> list[float]:
        _expire(self.window, now - WINDOW_S)
        return [seconds for _, seconds in self.window]


def _expire(window: deque, before: float) -> None:
    while window and window[0][0] < before:
        window.popleft()


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
    policy_choices: dict[str, int]  # "cycle" / "decode" -> drafting lanes' launches of that kind, since start
    policy_verified: int  # proposals the policy's cycles verified (Σ verify length k per owner): / policy_choices["cycle"] = mean k
    drafting_stopped: int  # sessions that stopped drafting for good: the policy's decode estimate, cycling losing (``Choice.stop``)
    device_s: float  # device time of the executor's loop launches, since start (its share of the wall time: how busy the device ran)
    loop_launches: int  # the executor's loop launches (programs of owner groups), since start
    loop_rounds: int  # ... the rounds they ran (a launch runs 1 or ``launch_rounds``): / loop_launches = rounds per launch
    lane_rounds: int  # ... the lanes' rounds in them (owner-cycles and decode steps): / loop_rounds = lanes per round
    uptime_s: float
    queue_wait_s: Percentiles  # over the recent window
    ttft_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    histograms: dict[str, Histogram]  # LATENCIES -> since the serving loop started

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExecuteTotals:
    """What executes did, summed over those read at once (``ServingLoop``'s ``ExecuteCursor``): owner-cycles,
    accepted proposals, executes and the failed ones among them, the policy's choices by kind, the proposals its
    cycles verified, the sessions that stopped drafting, the loop launches' device seconds, those launches, the
    rounds they ran and the lanes' rounds in them (``stats.lane_rounds``)."""

    cycles: int = 0
    accepted: int = 0
    executes: int = 0
    failed: int = 0
    choices: dict[str, int] = field(default_factory=dict)
    verified: int = 0
    stopped: int = 0
    device_s: float = 0.0
    launches: int = 0
    rounds: int = 0
    lane_rounds: int = 0

    def __add__(self, other: ExecuteTotals) -> ExecuteTotals:
        """Both reads' totals: every count summed, the choices by kind too."""
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "choices"}
        choices = dict(self.choices)
        for kind, count in other.choices.items():
            choices[kind] = choices.get(kind, 0) + count
        return ExecuteTotals(**summed, choices=choices)


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
        self.executed_totals = ExecuteTotals(choices={"cycle": 0, "decode": 0})  # every execute read since start
        self.latencies = {name: _Latency() for name in LATENCIES}
        self.deliveries: deque[list] = deque()  # [bucket start, tokens] within RATE_WINDOW_S

    def count(self, name: str, value: int = 1) -> None:
        with self.lock:
            self.counts[name] += value

    def joined(self, waited_s: float) -> None:
        with self.lock:
            self.latencies["queue_wait_s"].observe(time.perf_counter(), waited_s)

    def delivered(self, now: float, tokens: int, ttft_s: float | None, gap_s: float | None) -> None:
        with self.lock:
            self.counts["output_tokens"] += tokens
            if self.deliveries and now - self.deliveries[-1][0] < RATE_BUCKET_S:
                self.deliveries[-1][1] += tokens
            else:
                self.deliveries.append([now, tokens])
            _expire(self.deliveries, now - RATE_WINDOW_S)
            if ttft_s is not None:
                self.latencies["ttft_s"].observe(now, ttft_s)
            if gap_s is not None:
                self.latencies["itl_s"].observe(now, gap_s)

    def finished(self, outcome: str, latency_s: float) -> None:
        """A request ended (``completed`` or ``cancelled``) ``latency_s`` after its submit."""
        with self.lock:
            self.counts[outcome] += 1
            self.latencies["e2e_s"].observe(time.perf_counter(), latency_s)

    def executed(self, done: ExecuteTotals) -> None:
        """The executor's counters of executes that ended since the last call (``ExecuteCursor.read``)."""
        with self.lock:
            self.executed_totals += done

    def snapshot(self, running: int, queued: int) -> ServingMetrics:
        now = time.perf_counter()
        with self.lock:
            _expire(self.deliveries, now - RATE_WINDOW_S)
            window = min(RATE_WINDOW_S, now - self.started)
            rate = sum(n for _, n in self.deliveries) / window if window > 0 else 0.0
            done, counts = self.executed_totals, dict(self.counts)  # done: immutable, replaced by each read
            recent = {name: latency.recent(now) for name, latency in self.latencies.items()}
            histograms = {name: latency.histogram() for name, latency in self.latencies.items()}
        return ServingMetrics(
            running=running,
            queued=queued,
            **counts,
            output_tokens_per_s=rate,
            cycles=done.cycles,
            tau=1.0 + done.accepted / done.cycles if done.cycles else None,
            executes=done.executes,
            failed_executes=done.failed,
            policy_choices=dict(done.choices),
            policy_verified=done.verified,
            drafting_stopped=done.stopped,
            device_s=done.device_s,
            loop_launches=done.launches,
            loop_rounds=done.rounds,
            lane_rounds=done.lane_rounds,
            uptime_s=now - self.started,
            **{name: percentiles(samples) for name, samples in recent.items()},
            histograms=histograms,
        )
