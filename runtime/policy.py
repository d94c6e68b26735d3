"""Speculation that never loses: per round, a DFlash cycle or a plain decode step for the drafting lanes.

Pure math over what the loop measures (no torch); the executor asks for one
``Choice`` per round (the lanes it is about to launch together) and feeds
back each launch's cost and each cycle's acceptance.

Per lane, a round at ``n`` owners is either a cycle, costing ``C_cycle(n)``
seconds and yielding E[tokens per cycle] tokens, or a decode step, costing
``C_decode(n)`` and yielding one token. Cycle iff it yields more tokens per
second::

    ratio(n) = E[tokens per cycle] * C_decode(n) / C_cycle(n) > 1

E[tokens per cycle] = 1 + Σ_j P(a ≥ j), j = 1..P, from the acceptance by
draft position seen so far (``survival``: P(a ≥ j), an EWMA over cycles);
τ counts the bonus token, as ``runtime.stats`` defines it.

Costs are WALL seconds per launch, host work included (the launch call, the
wait for its verdict, and turning it into tokens, stats and streamed
deliveries): summed over launches they are the loop's wall time, so the
policy maximizes what callers receive per second. Device time alone
(``runtime.timing``) would miss what a busy serving thread spends per launch,
which is where a cycle at many owners loses (benchmarks/RESULTS.md,
"policy"). Costs are kept per (kind, padded owner count) as an EWMA; the
first launch of each key is not counted (it warms up: compiles, captures),
and a cost is known from its second counted launch on.

While a cost at ``n`` is unknown, the policy explores (runs the unknown
kind); once both are known it re-probes the losing kind every
``probe_every`` rounds at that count, so a stale estimate recovers when the
load changes. Hysteresis: the choice at ``n`` switches only when the ratio
crosses 1 by ``margin``, so it does not flap on noise.

``AlwaysCycle`` is the fixed policy (every drafting lane cycles whenever a
block fits), the behaviour before this module existed; ``--no-draft`` stays
the baseline without any drafting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

CYCLE, DECODE = "cycle", "decode"  # the kinds (device_loop's program kinds)
# Why a lane ran what it ran: the cycle table's ``policy`` column.
ESTIMATE, EXPLORE, PROBE, DRAIN, FIXED = "estimate", "explore", "probe", "drain", "fixed"
POLICIES = ("adaptive", "always")  # ``Executor(policy=...)``, ``--policy``


@dataclass(frozen=True)
class Choice:
    """One round's choice: the kind, why (``ESTIMATE``, ``EXPLORE``, ``PROBE``, ``FIXED``; the executor adds
    ``DRAIN``), and the estimated ratio at the decision (NaN while a cost is unknown)."""

    kind: str
    why: str
    ratio: float = math.nan


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


def expected_tokens(survival: np.ndarray) -> float:
    """E[tokens per cycle] from P(a ≥ j), j = 1..P: the accepted proposals and the correction/bonus token.

    >>> expected_tokens(np.array([0.5, 0.25, 0.0]))
    1.75
    """
    return 1.0 + float(np.sum(survival))


def survival_of(accepted: np.ndarray, proposals: int) -> np.ndarray:
    """P(a ≥ j) for j = 1..P over the cycles' accepted counts [m].

    >>> survival_of(np.array([0, 2, 3]), 3).tolist()
    [0.6666666666666666, 0.6666666666666666, 0.3333333333333333]
    """
    return (np.asarray(accepted)[:, None] >= np.arange(1, proposals + 1)[None, :]).mean(axis=0)


def cycle_ratio(tokens_per_cycle: float, cycle_s: float, decode_s: float) -> float:
    """Tokens per second of cycling over that of decoding, per lane (> 1: cycling pays).

    >>> cycle_ratio(3.0, 0.02, 0.005)
    0.75
    """
    return tokens_per_cycle * decode_s / cycle_s


@dataclass
class AdaptivePolicy:
    """Cycle or decode per round, from measured costs and acceptance (see the module docstring)."""

    proposals: int
    alpha: float = 0.2  # cost EWMA weight of a new launch
    acceptance_alpha: float = 0.05  # survival EWMA weight of a new launch's cycles
    margin: float = 0.05  # hysteresis: switch when the ratio crosses 1 ± margin
    probe_every: int = 64  # rounds at one owner count between probes of the losing kind
    costs: dict[tuple[str, int], Ewma] = field(default_factory=dict)
    survival: np.ndarray | None = None  # P(a ≥ j), j = 1..P; None before the first cycle
    last: dict[int, str] = field(default_factory=dict)  # owners -> the kind chosen last
    since_probe: dict[int, int] = field(default_factory=dict)  # owners -> rounds since the loser ran

    def observe_cost(self, kind: str, owners: int, seconds: float) -> None:
        """One launch of ``kind`` at ``owners`` (padded) took ``seconds`` of wall time."""
        self.costs.setdefault((kind, owners), Ewma(self.alpha)).add(seconds)

    def observe_accepted(self, accepted: np.ndarray) -> None:
        """One launch's cycles: their accepted counts [m]."""
        if len(accepted) == 0:
            return
        seen = survival_of(accepted, self.proposals)
        self.survival = seen if self.survival is None else self.survival + self.acceptance_alpha * (seen - self.survival)

    def cost(self, kind: str, owners: int) -> float | None:
        """The estimated seconds per launch; None until ``Ewma.known``."""
        ewma = self.costs.get((kind, owners))
        return ewma.value if ewma is not None and ewma.known else None

    def ratio(self, owners: int) -> float | None:
        """E[tokens per cycle] · C_decode / C_cycle at ``owners``; None while anything is unknown."""
        cycle, decode = self.cost(CYCLE, owners), self.cost(DECODE, owners)
        if cycle is None or decode is None or self.survival is None:
            return None
        return cycle_ratio(expected_tokens(self.survival), cycle, decode)

    def choose(self, owners: int) -> Choice:
        """The kind of the round at ``owners`` (padded) lanes."""
        ratio = self.ratio(owners)
        if ratio is None:
            unknown = CYCLE if self.cost(CYCLE, owners) is None or self.survival is None else DECODE
            return Choice(unknown, EXPLORE)
        previous = self.last.get(owners)
        threshold = 1.0 + self.margin if previous == DECODE else 1.0 - self.margin if previous == CYCLE else 1.0
        best = CYCLE if ratio > threshold else DECODE
        self.last[owners] = best
        rounds = self.since_probe.get(owners, 0) + 1
        if rounds > self.probe_every:
            self.since_probe[owners] = 0
            return Choice(DECODE if best == CYCLE else CYCLE, PROBE, ratio)
        self.since_probe[owners] = rounds
        return Choice(best, ESTIMATE, ratio)


@dataclass
class AlwaysCycle:
    """The fixed policy: every drafting lane cycles whenever a block fits."""

    proposals: int

    def observe_cost(self, kind: str, owners: int, seconds: float) -> None:
        pass

    def observe_accepted(self, accepted: np.ndarray) -> None:
        pass

    def choose(self, owners: int) -> Choice:
        return Choice(CYCLE, FIXED)


def make_policy(name: str, proposals: int) -> AdaptivePolicy | AlwaysCycle:
    """The policy named ``name`` (one of ``POLICIES``) for ``proposals`` proposals per cycle."""
    return {"adaptive": AdaptivePolicy, "always": AlwaysCycle}[name](proposals)
