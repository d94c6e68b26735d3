"""Speculation that never loses: per round, a DFlash cycle or a plain decode step for the drafting lanes.

Pure math over what the loop measures (no torch); the executor asks for one
``Choice`` per round (the lanes it is about to launch together, ``n`` of
them, padded to ``device_loop.owner_buckets``) and feeds back, per launch,
the kind and lane count of the round that caused it, its cost and the
tokens it yielded.

A round of ``n`` lanes is either cycles or decode steps; cycle iff cycle
rounds yield more tokens per second at ``n``::

    ratio(n) = (tokens / second of cycle rounds at n) / (tokens / second of decode rounds at n) > 1

With no other launches, a cycle round yields n · E[tokens per cycle] tokens
(the accepted proposals and the correction/bonus token: τ per owner) for
C_cycle(n) seconds and a decode round n tokens for C_decode(n), so this is
E[tokens per cycle] · C_decode(n) / C_cycle(n) > 1. Measured per round kind,
it also charges each kind with what it causes: a decode round's forced
drains (lanes whose pending context is full cycle: ``DRAIN``), split
launches, and launches whose tokens are discarded (a lane that finished).

Costs are WALL seconds per launch, host work included (the launch call, the
wait for its verdict, and turning it into tokens, stats and streamed
deliveries): summed over launches they are the loop's wall time, so the
policy maximizes what callers receive per second. Device time alone
(``runtime.timing``) would miss what a busy serving thread spends per launch
(benchmarks/RESULTS.md, "policy"). Costs and yields are kept per (round
kind, padded lane count) as EWMAs; the first launch of each key is not
counted (it warms up: compiles, captures), and a rate is known from its
second counted launch on.

While a rate at ``n`` is unknown, the policy explores (runs the unknown
kind); once both are known it re-probes the losing kind every
``probe_interval(ratio)`` rounds at that count, so a stale estimate recovers when the
load changes: ``probe_every`` (16) near break-even, doubling for every 25% the
estimate lies away from it, at most 8× (a probe costs in proportion to the gap,
and a far estimate needs a large change of load to flip). Hysteresis: the choice at ``n`` switches only when the ratio
crosses 1 by ``margin``, so it does not flap on noise.

``AlwaysCycle`` is the fixed policy (every drafting lane cycles whenever a
block fits), the behaviour before this module existed; ``--no-draft`` stays
the baseline without any drafting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CYCLE, DECODE = "cycle", "decode"  # the kinds (device_loop's program kinds)
# Why a lane ran what it ran: the cycle table's ``policy`` column.
ESTIMATE, EXPLORE, PROBE, DRAIN, FIXED = "estimate", "explore", "probe", "drain", "fixed"
POLICIES = ("adaptive", "always")  # ``Executor(policy=...)``, ``--policy``


@dataclass(frozen=True)
class Choice:
    """What a lane runs and why: ``kind``; ``why`` (``ESTIMATE``, ``EXPLORE``, ``PROBE``, ``FIXED``, or
    ``DRAIN`` from the executor); the estimated ratio at the decision (NaN while a rate is unknown); and
    the round it belongs to (its kind and padded lane count), which its launch's cost is charged to."""

    kind: str
    why: str
    ratio: float = math.nan
    round: str = ""
    owners: int = 0


@dataclass
class Ewma:
    """An exponentially weighted mean that ignores its first ``skip`` samples; the plain mean of the
    samples while there are fewer than 1 / alpha, so early samples are not overweighted; ``known``
    from ``least`` samples on."""

    alpha: float
    skip: int = 1
    least: int = 2
    value: float | None = None
    seen: int = 0

    def add(self, sample: float) -> None:
        self.seen += 1
        counted = self.seen - self.skip
        if counted <= 0:
            return
        weight = max(self.alpha, 1.0 / counted)
        self.value = sample if self.value is None else self.value + weight * (sample - self.value)

    @property
    def known(self) -> bool:
        return self.seen - self.skip >= self.least


def cycle_ratio(cycle_tokens_per_s: float, decode_tokens_per_s: float) -> float:
    """Tokens per second of cycle rounds over that of decode rounds (> 1: cycling pays).

    >>> cycle_ratio(150.0, 200.0)
    0.75
    """
    return cycle_tokens_per_s / decode_tokens_per_s


PROBE_STEP = 1.25  # each factor of this between the estimate and break-even doubles the probe interval
PROBE_SPREAD = 8  # ... up to this many times ``probe_every``


def probe_interval(probe_every: int, ratio: float) -> int:
    """Rounds between two probes of the losing kind at an estimated cycle / decode ``ratio``.

    >>> [probe_interval(16, r) for r in (1.0, 0.9, 0.75, 0.5, 0.39, 1.5, 4.0)]
    [16, 16, 32, 128, 128, 32, 128]
    """
    steps = int(abs(math.log(ratio)) / math.log(PROBE_STEP)) if ratio > 0 else PROBE_SPREAD
    return probe_every * min(PROBE_SPREAD, 2**steps)


@dataclass
class AdaptivePolicy:
    """Cycle or decode per round, from measured costs and yields (see the module docstring)."""

    alpha: float = 0.2  # EWMA weight of a new launch
    margin: float = 0.05  # hysteresis: switch when the ratio crosses 1 ± margin
    probe_every: int = 16  # rounds at one lane count between probes of the losing kind, near break-even
    costs: dict[tuple[str, int], Ewma] = field(default_factory=dict)  # (round kind, owners) -> seconds per launch
    yields: dict[tuple[str, int], Ewma] = field(default_factory=dict)  # ... -> tokens per launch
    last: dict[int, str] = field(default_factory=dict)  # owners -> the kind chosen last
    since_probe: dict[int, int] = field(default_factory=dict)  # owners -> rounds since the loser ran

    def observe(self, kind: str, owners: int, seconds: float, tokens: int) -> None:
        """One launch of a round of ``kind`` at ``owners`` (padded) lanes took ``seconds`` of wall time
        and yielded ``tokens`` (0 for one whose tokens were all discarded)."""
        self.costs.setdefault((kind, owners), Ewma(self.alpha)).add(seconds)
        self.yields.setdefault((kind, owners), Ewma(self.alpha)).add(tokens)

    def rate(self, kind: str, owners: int) -> float | None:
        """Tokens per second of rounds of ``kind`` at ``owners``; None until ``Ewma.known``."""
        cost, tokens = self.costs.get((kind, owners)), self.yields.get((kind, owners))
        if cost is None or not cost.known or cost.value <= 0:
            return None
        return tokens.value / cost.value

    def ratio(self, owners: int) -> float | None:
        """Cycle rounds' tokens per second over decode rounds' at ``owners``; None while either is unknown."""
        cycle, decode = self.rate(CYCLE, owners), self.rate(DECODE, owners)
        if cycle is None or decode is None or decode <= 0:
            return None
        return cycle_ratio(cycle, decode)

    def choose(self, owners: int) -> Choice:
        """The kind of the round at ``owners`` (padded) lanes."""
        ratio = self.ratio(owners)
        if ratio is None:
            unknown = CYCLE if self.rate(CYCLE, owners) is None else DECODE
            return Choice(unknown, EXPLORE, math.nan, unknown, owners)
        previous = self.last.get(owners)
        threshold = 1.0 + self.margin if previous == DECODE else 1.0 - self.margin if previous == CYCLE else 1.0
        best = CYCLE if ratio > threshold else DECODE
        self.last[owners] = best
        rounds = self.since_probe.get(owners, 0) + 1
        if rounds > probe_interval(self.probe_every, ratio):
            self.since_probe[owners] = 0
            loser = DECODE if best == CYCLE else CYCLE
            return Choice(loser, PROBE, ratio, loser, owners)
        self.since_probe[owners] = rounds
        return Choice(best, ESTIMATE, ratio, best, owners)


@dataclass
class AlwaysCycle:
    """The fixed policy: every drafting lane cycles whenever a block fits."""

    def observe(self, kind: str, owners: int, seconds: float, tokens: int) -> None:
        pass

    def choose(self, owners: int) -> Choice:
        return Choice(CYCLE, FIXED, math.nan, CYCLE, owners)


def make_policy(name: str) -> AdaptivePolicy | AlwaysCycle:
    """The policy named ``name`` (one of ``POLICIES``)."""
    return {"adaptive": AdaptivePolicy, "always": AlwaysCycle}[name]()
