"""The speculation policy (runtime/policy.py) against brute force, and the executor under forced and
adaptive policies against the reference: lossless, exact pending context, counted choices."""

from __future__ import annotations

import copy
import itertools
import math
import time

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.errors import InputError
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.launches import Flight
from dflash_trt.runtime.policy import (
    COST_CLIP, CYCLE, DECODE, DRAIN, ESTIMATE, EXPLORE, FIXED, PROBE, PROBE_SPREAD, SWITCH, AdaptivePolicy, Choice, cycle_ratio,
    probe_interval,
)
from dflash_trt.runtime.policy import make_policy as policy_named
from dflash_trt.runtime.finish import LENGTH
from dflash_trt.runtime.sessions import Input, validate_batch
from executor_fixtures import DraftReference, RecordingBackend, Tracker, assert_context, tiny_dims

TINY_ROWS = 8


# ------------------------------------------------------------------ the policy's math


def launches_of(kind: str, lanes: int, accepted: np.ndarray, cycle_s: float, decode_s: float, drains: int = 0):
    """One round's launches as (seconds, tokens, launch kind): a cycle of ``lanes`` owners yields a + 1 each; a
    decode round yields one per lane, plus ``drains`` of its lanes cycling apart (each drain a cycle launch)."""
    if kind == CYCLE:
        return [(cycle_s, int(np.sum(accepted[:lanes] + 1)), CYCLE)]
    drained = [(cycle_s, int(np.sum(accepted[:drains] + 1)), CYCLE)] if drains else []
    return [(decode_s, lanes - drains, DECODE), *drained]


def brute_force_best(accepted: np.ndarray, lanes: int, cycle_s: float, decode_s: float, drains: int) -> tuple[str, float]:
    """The kind whose rounds deliver more tokens per second, and the ratio: Σ tokens / Σ seconds of each round's
    launches of its own kind. A decode round's drains are cycle launches of lanes that cycle whichever kind the
    round chose: they rate neither option."""
    rates = {}
    for kind in (CYCLE, DECODE):
        launches = [launch for launch in launches_of(kind, lanes, accepted, cycle_s, decode_s, drains) if launch[2] == kind]
        rates[kind] = sum(t for _, t, _ in launches) / sum(s for s, _, _ in launches)
    return max(rates, key=rates.get), rates[CYCLE] / rates[DECODE]


def test_choice_maximizes_tokens_per_second_against_brute_force():
    """Guards against a wrong decision rule (τ without the bonus token, the cost ratio inverted, rates of
    another lane count, a decode round's forced drains charged to decode: they are cycles, so decode was rated
    by a blend of both kinds, near break-even whenever cycling pays): on random acceptances, costs and drains
    the policy must pick the kind whose rounds deliver more tokens per second by brute force, and report the
    ratio."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        lanes = int(rng.choice([1, 2, 4, 16, 64]))
        accepted = np.minimum(rng.geometric(rng.uniform(0.1, 0.9), lanes) - 1, 15)
        cycle_s, decode_s = rng.uniform(1e-3, 5e-2), rng.uniform(1e-3, 2e-2)
        drains = int(rng.integers(0, lanes)) if lanes > 1 else 0
        policy = AdaptivePolicy(margin=0.0, probe_every=10**9)
        for kind in (CYCLE, DECODE):
            policy.observe(kind, lanes, 1.0, 0)  # the first launch of each round kind is a warm-up: not counted
            for _ in range(2):  # whole rounds (fewer launches than 1 / alpha: their plain mean)
                for seconds, tokens, launch in launches_of(kind, lanes, accepted, cycle_s, decode_s, drains):
                    policy.observe(kind, lanes, seconds, tokens, launch=launch)
        best, ratio = brute_force_best(accepted, lanes, cycle_s, decode_s, drains)
        if math.isclose(ratio, 1.0, rel_tol=1e-9):
            continue
        choice = policy.choose(lanes)
        assert (choice.kind, choice.why, choice.round, choice.owners) == (best, ESTIMATE, best, lanes), (trial, ratio, choice)
        assert choice.ratio == pytest.approx(ratio)


LENGTHS = (3, 7, 15)


def censored_reach(verified: np.ndarray, accepted: np.ndarray, position: int) -> float:
    """Brute force: among owner-cycles that verified ``position`` or more proposals, the share that accepted
    the first ``position`` (a cycle verifying k accepts at most k: it says nothing about positions past k)."""
    tried = accepted[verified >= position]
    return float(np.mean(tried >= position))


def test_the_verify_length_maximizes_tokens_per_second_against_brute_force():
    """Guards against choosing how many proposals to verify wrongly: expected tokens not truncated at k,
    acceptance at a position counted from cycles that never verified it (a cycle of 3 accepting all 3
    is no evidence about the 4th), the bonus token dropped, or a length's rate taken from another's
    cost. On random acceptances seen through cycles of random lengths and random costs per length, the
    policy must pick what delivers the most tokens per second by brute force — decode (measured), or a
    cycle of k proposals: lanes · (1 + Σ_{i ≤ k} share accepting the first i) / its cost per launch —
    and report the best cycle's ratio to decode."""
    rng = np.random.default_rng(1)
    for trial in range(300):
        lanes, launches = int(rng.choice([1, 2, 4])), 40
        truth = np.minimum(rng.geometric(1 - rng.uniform(0.2, 0.95), size=(launches, lanes)) - 1, 15)
        verified = np.where(np.arange(launches) == 0, 15, rng.choice(LENGTHS, size=launches))  # the first explores at P
        seen = np.minimum(truth, verified[:, None])
        policy = AdaptivePolicy(margin=0.0, probe_every=10**9, lengths=LENGTHS)
        for k, accepted in zip(verified, seen):
            policy.accept(int(k), accepted.tolist())
        per_row, fixed = rng.uniform(1e-4, 3e-3), rng.uniform(1e-3, 2e-2)
        costs = {k: fixed + per_row * (k + 1) * rng.uniform(0.8, 1.2) for k in LENGTHS}
        decode_s = rng.uniform(0.3, 1.0) * (fixed + per_row)
        for k, seconds in costs.items():
            for s in (1.0, seconds, seconds):  # a warm-up, then two counted launches
                policy.observe(CYCLE, lanes, s, 0, lanes, k)  # tokens as measured are ignored once acceptance is known
        for s in (1.0, decode_s, decode_s):
            policy.observe(DECODE, lanes, s, lanes)
        expected = {k: 1 + sum(censored_reach(np.repeat(verified, lanes), seen.ravel(), i) for i in range(1, k + 1)) for k in LENGTHS}
        rates = {(CYCLE, k): lanes * expected[k] / costs[k] for k in LENGTHS} | {(DECODE, 0): lanes / decode_s}
        ordered = sorted(rates.values())
        if math.isclose(ordered[-1], ordered[-2], rel_tol=1e-9):
            continue
        best = max(rates, key=rates.get)
        choice = policy.choose(lanes)
        assert (choice.kind, choice.why, choice.owners) == (best[0], ESTIMATE, lanes), (trial, rates, choice)
        if best[0] == CYCLE:
            assert choice.proposals == best[1], (trial, rates, choice)
        best_cycle = max(rate for (kind, _), rate in rates.items() if kind == CYCLE)
        assert choice.ratio == pytest.approx(best_cycle / rates[(DECODE, 0)])


def test_a_longer_verify_is_never_rated_cheaper_than_a_shorter_one():
    """Guards against a noisy low cost sample making a longer verify look cheaper than a shorter one
    (the same draft and a superset of the verify rows cannot cost less): with no acceptance past 7
    proposals (7 and 15 yield the same), a 15-cycle measured at 8 ms against a 7-cycle at 10 ms is rated
    at 10 ms, and the 7-cycle is chosen (a tie goes to the shorter); measured dearer, the 15-cycle keeps
    its own cost."""
    policy = AdaptivePolicy(margin=0.0, probe_every=10**9, lengths=LENGTHS)
    for _ in range(5):
        policy.accept(15, [2, 7, 0, 4])
    for k, seconds in ((3, 0.009), (7, 0.010), (15, 0.008)):
        for s in (1.0, seconds, seconds):
            policy.observe(CYCLE, 4, s, 0, 4, k)
    for s in (1.0, 0.020, 0.020):
        policy.observe(DECODE, 4, s, 4)
    E = {k: policy.expected(k) for k in LENGTHS}
    assert E[7] == E[15] > E[3]
    assert policy.rate(CYCLE, 4, 15) == pytest.approx(4 * E[15] / 0.010) and policy.rate(CYCLE, 4, 7) == pytest.approx(4 * E[7] / 0.010)
    assert policy.rate(CYCLE, 4, 3) == pytest.approx(4 * E[3] / 0.009)
    assert (policy.choose(4).kind, policy.choose(4).proposals) == (CYCLE, 7)
    for s in (0.012, 0.012, 0.012, 0.012, 0.012, 0.012, 0.012, 0.012, 0.012, 0.012):
        policy.observe(CYCLE, 4, s, 0, 4, 15)
    assert policy.rate(CYCLE, 4, 15) == pytest.approx(4 * E[15] / policy.costs[(CYCLE, 4, 15)].value)


def test_expected_tokens_of_a_length_truncate_the_acceptance_seen_at_p():
    """Guards against the expected tokens of a shorter verify not being what truncating each cycle at k
    gives: from cycles verifying all P, E[tokens of a k-cycle] = 1 + mean(min(a, k)); unknown (None)
    for a length past every position seen."""
    rng = np.random.default_rng(2)
    accepted = np.minimum(rng.geometric(0.3, size=(30, 4)) - 1, 7)
    policy = AdaptivePolicy(lengths=(3, 7))
    for launch in accepted:
        policy.accept(7, launch.tolist())
    for k in (1, 3, 5, 7):
        assert policy.expected(k) == pytest.approx(1 + np.mean(np.minimum(accepted, k)))
    assert AdaptivePolicy(lengths=(3, 7)).expected(3) is None and policy.expected(8) is None


def test_every_length_is_explored_before_estimating_and_probes_keep_them_measured():
    """Guards against a length that never runs (its cost stays unknown and it could never be chosen) and
    against estimating before every option is known: exploration runs the longest cycle first (its verdicts
    measure every position), then decode, then the shorter lengths; once all are known every losing option
    is probed now and then, not only the runner-up."""
    policy = AdaptivePolicy(probe_every=2, lengths=LENGTHS)
    order = []
    for _ in range(40):
        choice = policy.choose(1)
        order.append((choice.kind, choice.proposals if choice.kind == CYCLE else 0, choice.why))
        if choice.kind == CYCLE:
            policy.accept(choice.proposals, [min(2, choice.proposals)])
            policy.observe(CYCLE, 1, 0.004 + 0.001 * choice.proposals, 3, 1, choice.proposals)
        else:
            policy.observe(DECODE, 1, 0.004, 1)
    explored = [(kind, k) for kind, k, why in order if why == EXPLORE]
    assert explored == [(CYCLE, 15)] * 3 + [(DECODE, 0)] * 3 + [(CYCLE, 7)] * 3 + [(CYCLE, 3)] * 3
    estimated = [(kind, k) for kind, k, why in order if why == ESTIMATE]
    assert set(estimated) == {(CYCLE, 3)}  # a = 2 always: 3 tokens at 7 ms beats 3 at 11 or 19 ms and 1 at 4 ms
    assert {(kind, k) for kind, k, why in order if why == PROBE} == {(CYCLE, 15), (CYCLE, 7), (DECODE, 0)}


def test_the_ratio_is_tau_times_the_cost_ratio_without_drains():
    """Guards against a rate that is not per lane-token: with one launch per round the ratio must be
    E[tokens per cycle] · C_decode / C_cycle (τ counting the bonus token), whatever the lane count."""
    accepted = np.array([0, 3, 5, 2])  # τ = 3.5
    policy = AdaptivePolicy()
    for _ in range(3):
        policy.observe(CYCLE, 4, 0.020, int(np.sum(accepted + 1)))
        policy.observe(DECODE, 4, 0.005, 4)
    assert policy.ratio(4) == pytest.approx(3.5 * 0.005 / 0.020)


def test_unknown_rates_are_explored_and_the_first_launch_is_not_counted():
    """Guards against deciding from nothing (a kind never measured at this lane count would never run,
    so its rate would stay unknown) and against a warm-up launch (compiles, captures) setting the cost."""
    policy = AdaptivePolicy(margin=0.0)
    assert policy.choose(4) == Choice(CYCLE, EXPLORE, pytest.approx(math.nan, nan_ok=True), CYCLE, 4)
    policy.observe(CYCLE, 4, 10.0, 16)  # warm-up: ignored
    policy.observe(CYCLE, 4, 0.020, 16)
    assert policy.choose(4).kind == CYCLE and policy.rate(CYCLE, 4) is None  # one counted launch: not known yet
    policy.observe(CYCLE, 4, 0.020, 16)
    assert policy.rate(CYCLE, 4) == pytest.approx(800.0)
    assert policy.choose(4).kind == DECODE and policy.choose(4).why == EXPLORE  # the decode rate is the unknown one now
    for seconds in (1.0, 0.004, 0.004):
        policy.observe(DECODE, 4, seconds, 4)
    choice = policy.choose(4)  # 4 tokens per lane-cycle at 20 ms against 1 per 4 ms: ratio 0.8
    assert (choice.kind, choice.why, choice.ratio) == (DECODE, ESTIMATE, pytest.approx(0.8))
    assert policy.choose(2).why == EXPLORE  # another lane count is measured on its own


def known(**options) -> AdaptivePolicy:
    policy = AdaptivePolicy(**options)
    for _ in range(3):
        policy.observe(CYCLE, 1, 0.010, 2)  # 200 tokens/s
        policy.observe(DECODE, 1, 0.005, 1)
    return policy


def set_decode_rate(policy: AdaptivePolicy, ratio: float) -> None:
    """Make the decode rate such that cycle / decode = ``ratio`` (cycle rounds: 200 tokens/s)."""
    policy.costs[(DECODE, 1, 0)].value = ratio * policy.yields[(DECODE, 1, 0)].value / 200.0


def test_hysteresis_keeps_the_choice_inside_the_margin_and_switches_outside():
    """Guards against flapping between cycles and decode steps on noise: a ratio within ±margin of 1
    keeps the previous choice at that lane count; beyond it the choice switches."""
    policy = known(margin=0.05, probe_every=10**9)
    for ratio, kind in ((0.96, DECODE), (1.04, DECODE), (1.02, DECODE), (1.08, CYCLE), (0.98, CYCLE), (0.90, DECODE)):
        set_decode_rate(policy, ratio)
        choice = policy.choose(1)
        assert choice.kind == kind and choice.ratio == pytest.approx(ratio), (ratio, choice)


def test_only_a_decode_estimate_with_cycling_losing_stops_drafting():
    """Guards against lanes that stop drafting for good on a choice that does not say cycling loses: a
    decode kept by hysteresis while cycles are ahead (ratio in (1, 1 + margin]), an exploration, a probe
    of decode, or ``adaptive`` (only ``adaptive-stop`` stops drafting). Only a decode by estimate with
    the best cycle's ratio below 1 carries ``stop``."""
    policy = known(margin=0.05, probe_every=10**9, stop_drafting=True)
    seen = []
    for ratio in (0.96, 1.04, 1.08, 0.98, 0.90):
        set_decode_rate(policy, ratio)
        choice = policy.choose(1)
        seen.append((choice.kind, choice.stop))
    assert seen == [(DECODE, True), (DECODE, False), (CYCLE, False), (CYCLE, False), (DECODE, True)]
    assert not AdaptivePolicy(stop_drafting=True).choose(1).stop  # nothing known: an exploration
    probing = known(margin=0.0, probe_every=1, stop_drafting=True)
    set_decode_rate(probing, 1.5)  # cycles chosen: decode is probed every other round
    choices = [probing.choose(1) for _ in range(6)]
    assert any(c.kind == DECODE and c.why == PROBE for c in choices) and not any(c.stop for c in choices)
    keeping = known()  # ``adaptive``: drafting is never stopped
    set_decode_rate(keeping, 0.5)
    assert keeping.choose(1).kind == DECODE and not keeping.choose(1).stop
    assert policy_named("adaptive-stop").stop_drafting and not policy_named("adaptive").stop_drafting


def test_a_hopeless_draft_stops_drafting_on_decode_rounds_whatever_the_policy_name():
    """Guards against DFlash mode that stays dearer than plain decoding with a draft that is never accepted
    (Qwen3-8B shape, random draft, H200: 0.94x plain under ``adaptive``, its drains and probes 15 of 64
    rounds): once at least HOPELESS_EVIDENCE owner-cycles were verified and under HOPELESS_SHARE of them
    accepted the first proposal, a decode round (by estimate or kept, not a probe or an exploration) carries
    ``hopeless`` under ``adaptive`` too; a draft accepted 3 times in 10 never does, nor does too little
    evidence, a cycle round or the fixed policy."""
    from dflash_trt.runtime.policy import HOPELESS_EVIDENCE, HOPELESS_SHARE

    assert not AdaptivePolicy().choose(1).hopeless  # nothing known: an exploration
    policy = known(margin=0.05, probe_every=10**9)
    set_decode_rate(policy, 0.5)
    for _ in range(HOPELESS_EVIDENCE - 1):
        policy.accept(15, [0])
    assert policy.choose(1).kind == DECODE and not policy.choose(1).hopeless  # one owner-cycle short of the evidence
    policy.accept(15, [0])
    assert policy.choose(1).kind == DECODE and policy.choose(1).hopeless and not policy.choose(1).stop
    set_decode_rate(policy, 1.5)  # cycles ahead by estimate (not a hopeless draft's costs, but the rule is per choice)
    assert policy.choose(1).kind == CYCLE and not policy.choose(1).hopeless
    accepted = known(margin=0.05, probe_every=10**9)
    set_decode_rate(accepted, 0.5)
    rng = np.random.default_rng(0)
    accepted.accept(15, (rng.random(4 * HOPELESS_EVIDENCE) < 0.3).astype(int))  # a first position accepted 3 in 10
    assert accepted.reached[0].value > HOPELESS_SHARE and not accepted.choose(1).hopeless
    probing = known(margin=0.0, probe_every=1)
    probing.accept(15, [0] * HOPELESS_EVIDENCE)
    set_decode_rate(probing, 0.9)  # decode chosen, cycles probed every other round
    choices = [probing.choose(1) for _ in range(6)]
    assert any(c.why == PROBE for c in choices) and not any(c.hopeless for c in choices if c.why == PROBE)
    assert any(c.hopeless for c in choices)
    assert not policy_named("always").choose(1).hopeless


def test_decode_is_rated_by_its_plain_steps():
    """Guards against rating decode by the drain cycles its rounds run: a drain is a cycle of lanes that cycle
    whichever kind the round chose, so counting its cost and tokens in decode's rated decode by a blend of both
    kinds, near cycling's whenever cycling pays (on the host proxy with a stand-in device, ``python
    benchmarks/host_cost.py --clients 16 --launch-rounds 4 --device-us 390 230 7.5``: 15-23% of the lane-rounds
    decoded, where cycles yield twice as much per device second). ``adaptive-stop`` never runs those drains
    (it stops drafting instead) and ``adaptive`` runs them as cycles: both rate decode by its plain steps."""
    for stop in (False, True):
        policy = AdaptivePolicy(stop_drafting=stop)
        for _ in range(3):  # a decode step of 4 lanes, then a drain cycle of them at 5 ms yielding 8
            policy.observe(DECODE, 4, 0.001, 4)
            policy.observe(DECODE, 4, 0.005, 8, launch=CYCLE)
        cost, tokens = policy.costs[(DECODE, 4, 0)].value, policy.yields[(DECODE, 4, 0)].value
        assert cost == pytest.approx(0.001) and tokens == pytest.approx(4.0), (stop, cost, tokens)


def test_the_losing_kind_is_probed_so_a_stale_estimate_recovers():
    """Guards against a losing kind that is never run again: its rate is then frozen at its old value and
    the policy cannot notice when the load changes. Every ``probe_interval`` rounds the loser runs once; as
    its cost is re-measured lower the choice follows."""
    policy = AdaptivePolicy(margin=0.0, probe_every=4)
    for _ in range(3):
        policy.observe(CYCLE, 2, 0.030, 6)  # 200 tokens/s
        policy.observe(DECODE, 2, 0.005, 2)  # 400 tokens/s: decode
    gap = probe_interval(4, 0.5)
    choices = [policy.choose(2) for _ in range(2 * gap + 2)]
    assert [c.why for c in choices] == ([ESTIMATE] * gap + [PROBE]) * 2
    assert all(c.kind == c.round == CYCLE for c in choices if c.why == PROBE) and all(c.kind == DECODE for c in choices if c.why == ESTIMATE)
    kinds = []
    for _ in range(400):  # the load changed: cycle rounds now cost 10 ms (each probe measures one)
        kinds.append(policy.choose(2).kind)
        if kinds[-1] == CYCLE:
            policy.observe(CYCLE, 2, 0.010, 6)
    assert kinds[:gap] == [DECODE] * gap  # still the old estimate until the next probe
    assert policy.choose(2).ratio == pytest.approx(1.5, rel=1e-3)  # switched: cycles at 600 tokens/s
    tail = probe_interval(4, 1.5) + 1
    assert kinds[-4 * tail :].count(DECODE) == 4  # decode now the probed loser, once per interval


def test_probes_are_rarer_the_farther_the_estimate_is_from_break_even():
    """Guards against probing a clearly losing kind as often as a close one (each probe of a kind that
    delivers a third of the other's tokens per second costs a round's worth of throughput), and against
    never probing at all: the interval is ``probe_every`` near break-even, the same for a ratio and its
    inverse, grows with the distance and is capped at PROBE_SPREAD times ``probe_every``."""
    ratios = [1.0, 1.1, 1.3, 1.7, 2.5, 5.0, 100.0]
    gaps = [probe_interval(16, r) for r in ratios]
    assert gaps[0] == 16 and gaps == sorted(gaps) and gaps[-1] == 16 * PROBE_SPREAD
    assert [probe_interval(16, 1 / r) for r in ratios] == gaps
    assert probe_interval(16, 0.0) == 16 * PROBE_SPREAD


def run_rounds(policy: AdaptivePolicy, rounds: int, cycle_s, decode_s: float, lanes: int = 16, tau: float = 2.8) -> list[str]:
    """``rounds`` rounds of ``policy`` at ``lanes`` lanes against true costs, one launch each: a cycle yields
    lanes · tau tokens in ``cycle_s(i)`` seconds (its i-th launch), a decode step one token per lane in
    ``decode_s``. Returns the kinds chosen."""
    kinds, cycles = [], 0
    for _ in range(rounds):
        choice = policy.choose(lanes)
        if choice.kind == CYCLE:
            seconds, tokens, cycles = cycle_s(cycles), round(lanes * tau), cycles + 1
        else:
            seconds, tokens = decode_s, lanes
        policy.observe(choice.kind, lanes, seconds, tokens, lanes, choice.proposals)
        kinds.append(choice.kind)
    return kinds


def test_one_stalled_launch_does_not_turn_the_policy_for_hundreds_of_rounds():
    """Bug: one cycle launch whose wall time caught a host stall (a garbage collection, a page fault, a burst
    of a neighbour: 60 ms against 1 ms) raised the cycle's cost estimate ~12-fold; cycles then looked 8x worse
    than decode steps, were probed only every 128 rounds and each probe wore the stall off by a fifth: over a
    thousand rounds of plain decoding where cycles deliver 1.68x its tokens per second (brute force below).
    A lasting rise must still be followed within the launches the clip allows (each may raise the mean by
    alpha · (COST_CLIP - 1))."""
    cycle_s, decode_s, lanes, tau = 1e-3, 6e-4, 16, 2.8
    assert brute_force_best(np.full(lanes, round(tau) - 1), lanes, cycle_s, decode_s, 0)[0] == CYCLE
    stall_at = 40  # the 40th cycle launch stalls
    policy = AdaptivePolicy()
    kinds = run_rounds(policy, 800, lambda i: 0.060 if i == stall_at else cycle_s, decode_s, lanes, tau)
    after = kinds[kinds.index(CYCLE) + stall_at + 50 :]  # past the stall (and the exploration)
    probes = len(after) // probe_interval(policy.probe_every, cycle_ratio(lanes * tau / cycle_s, lanes / decode_s)) + 2
    assert after.count(DECODE) <= probes, f"{after.count(DECODE)} decode rounds of {len(after)} after one stall"
    # A lasting rise (cycles now 6 ms: decode steps deliver 3.6x their tokens per second) is followed.
    policy = AdaptivePolicy()
    kinds = run_rounds(policy, 200, lambda i: cycle_s if i < 60 else 0.006, decode_s, lanes, tau)
    risen = [i for i, kind in enumerate(kinds) if kind == CYCLE][60]  # the round of the first dear cycle
    # The cost estimate must grow past break-even (the ratio, with the hysteresis margin) at (1 + alpha (clip - 1)) a launch.
    growth = 1 + policy.alpha * (COST_CLIP - 1)
    needed = math.ceil(math.log(cycle_ratio(lanes * tau / cycle_s, lanes / decode_s) * (1 + policy.margin)) / math.log(growth))
    assert kinds[risen + 1 :][: needed + 6].count(CYCLE) <= needed and kinds[-20:].count(DECODE) >= 18, (needed, kinds[risen:])


def stalling_rounds(policy: AdaptivePolicy, rounds: int, cycle_s: float, decode_s: float, lanes: int, tau: float, share: float,
                    stall_s: float, seed: int) -> list[tuple[str, str]]:
    """``rounds`` rounds against true costs where a ``share`` of launches, at random, also waits ``stall_s`` (a
    busy host: preemption, a neighbour's burst): a cycle yields lanes · tau tokens in ``cycle_s``, a decode step
    one per lane in ``decode_s``. Returns each round's (kind, why)."""
    stalls = np.random.default_rng(seed).random(rounds) < share
    chosen = []
    for stalled in stalls:
        choice = policy.choose(lanes)
        seconds, tokens = (cycle_s, round(lanes * tau)) if choice.kind == CYCLE else (decode_s, lanes)
        policy.observe(choice.kind, lanes, seconds + stall_s * stalled, tokens, lanes, choice.proposals)
        chosen.append((choice.kind, choice.why))
    return chosen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("tau", "winner"), [(3.5, CYCLE), (1.3, DECODE)])
def test_a_host_that_stalls_often_does_not_turn_the_choice(seed, tau, winner):
    """Bug: on a host where one launch in ten stalls 3 ms (launches of 0.1-0.23 ms), a cost sample counted up to
    3x the mean, and a stall among an option's first samples counted in full: the option run every round (its
    mean over stalls) was compared with the one only probed (its last quiet probe), and a stall among the
    probed option's first samples held it off for hundreds of rounds: 3.5-23% of the rounds ran the losing kind
    by estimate, where cycling's rounds deliver 1.52x decode's tokens per second at tau 3.5 and 0.57x at tau 1.3. Stalls
    strike both kinds alike, so the choice must be the stall-free one's."""
    cycle_s, decode_s, lanes = 2.3e-4, 1e-4, 16
    assert (cycle_ratio(round(lanes * tau) / cycle_s, lanes / decode_s) > 1) == (winner == CYCLE)  # the stall-free truth
    chosen = stalling_rounds(AdaptivePolicy(), 5000, cycle_s, decode_s, lanes, tau, 0.1, 3e-3, seed)[200:]  # past the exploration
    losing = sum(kind != winner and why == ESTIMATE for kind, why in chosen)
    assert losing <= len(chosen) // 100, f"{losing} of {len(chosen)} rounds chose the losing kind by estimate"


def test_unknown_policy_names_are_refused(tiny):
    """Guards against a typo silently running another policy."""
    with pytest.raises(InputError, match=r"policy must be one of \('adaptive', 'always', 'adaptive-stop'\).*'sometimes'"):
        Executor(tiny.ort, tiny.dims, 2, policy="sometimes")


@pytest.mark.parametrize(("option", "value", "words"), [
    ("lag", 4, r"lag must be an int in \[0, 3\] \(or a bool\), got 4"),
    ("lag", -1, r"lag must be an int in \[0, 3\] \(or a bool\), got -1"),
    ("lag", 1.5, r"lag must be an int in \[0, 3\] \(or a bool\), got 1.5"),
    ("launch_rounds", 0, r"launch_rounds must be an int in \[1, 8\], got 0"),
])
def test_out_of_range_loop_options_are_refused(tiny, option, value, words):
    """Guards against a launch depth or rounds per launch outside what the executor offers accepted silently (a
    fractional lag truncated, a negative one read as no lag), with a typed error naming the option, its range
    and the value seen."""
    with pytest.raises(InputError, match=words):
        Executor(tiny.ort, tiny.dims, 2, **{option: value})


# ------------------------------------------------------------------ the executor under a policy


STOP = "stop"  # a Scripted entry: a decode round whose full lanes stop drafting (``Choice.stop``)
HOPELESS = "hopeless"  # a Scripted entry: a decode round while the draft is hopeless (``Choice.hopeless``)


class Scripted:
    """A policy forced to a fixed pattern, one entry per round (``choose``): a kind, (CYCLE, verify length) or STOP."""

    def __init__(self, pattern: list) -> None:
        self.pattern = itertools.cycle(pattern)
        self.launches: list[tuple[str, int, float, int]] = []
        self.lengths: list[int] = []  # the verify length of every cycle launch read

    def choose(self, owners: int) -> Choice:
        if (entry := next(self.pattern)) == STOP:  # decode by estimate, cycling losing: full lanes stop drafting
            return Choice(DECODE, ESTIMATE, 0.5, DECODE, owners, 0, stop=True)
        if entry == HOPELESS:  # ... the draft never accepted: they stop beside plain lanes too
            return Choice(DECODE, ESTIMATE, 0.5, DECODE, owners, 0, hopeless=True)
        kind, length = entry if isinstance(entry, tuple) else (entry, 0)
        return Choice(kind, EXPLORE, math.nan, kind, owners, length)

    def observe(
        self, kind: str, owners: int, seconds: float, tokens: int, lanes: int | None = None, proposals: int = 0, launch: str | None = None
    ) -> None:
        self.launches.append((kind, owners, seconds, tokens))

    def accept(self, proposals: int, accepted: list[int]) -> None:
        assert all(0 <= a <= proposals for a in accepted), (proposals, accepted)
        self.lengths.append(proposals)


def make_policy(name: str, lengths: tuple[int, ...]):
    if name == "adaptive":
        return AdaptivePolicy(probe_every=2, lengths=lengths)  # probes often: every option runs in a short test
    patterns = {
        "alternate": [CYCLE, DECODE],
        "decode": [DECODE],
        "stopping": [CYCLE, CYCLE, *[STOP] * 40],  # pending rows fill under the decode rounds
        "hopeless": [CYCLE, CYCLE, *[HOPELESS] * 40],
        "lengths, then stopping": [(CYCLE, lengths[0]), (CYCLE, lengths[1]), DECODE, *[STOP] * 30],
        "mixed": [DECODE, DECODE, CYCLE, DECODE, CYCLE, CYCLE],
        "lengths": [(CYCLE, lengths[0]), (CYCLE, lengths[0]), DECODE, (CYCLE, lengths[-1]), (CYCLE, lengths[0]), DECODE, DECODE],
    }
    return Scripted(patterns[name])


def policy_executor(tiny, backend: str, policy) -> tuple[Executor, RecordingBackend]:
    if backend == "onnxruntime":
        inner, dims = tiny.ort, tiny.dims
    elif backend == "torch-cuda":  # the fast path's programs captured as CUDA graphs; copies: the CPU oracle keeps the originals
        from dflash_trt.runtime.backends.torch_backend import TorchBackend

        dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context)
        inner = TorchBackend(copy.deepcopy(tiny.target), copy.deepcopy(tiny.draft), dims, TINY_ROWS, device="cuda")
    else:
        dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context)
        inner = tiny.torch_backend(dims, TINY_ROWS, "fast" if backend == "torch-fast" else "auto")
    recording = RecordingBackend(inner)
    return Executor(recording, dims, TINY_ROWS, policy=policy), recording


def workload(tracker: Tracker, execute, sessions: list[int], rounds: int) -> None:
    """Prompts of several lengths, then budgeted executes (several launches each, lag on) and single
    steps, until the sessions reach the context end (its last tokens: plain decode steps)."""
    prompts = [[3 + (7 * s + k) % 80 for k in range(n)] for s, n in zip(sessions, (1, 5, 9, 17, 24))]
    execute([(s, p, None, True) for s, p in zip(sessions, prompts)])
    for r in range(rounds):
        live = [s for s in sessions if tracker.pending[s] and tracker.frontier(s) + 1 <= tracker.executor.dims.max_context]
        if not live:
            return
        budget = {"max_new_tokens": 1 + (5 * r) % 11} if r % 3 else {}
        execute([(s, [tracker.seq[s][-1]], None, True, budget) for s in live])


def checked_execute(tiny, tracker: Tracker, backend: RecordingBackend):
    """tracker.execute (outputs against the target-only reference), then every draft call's proposals
    against the reference draft's for its sequence: the context the draft consumed was exact. A cycle
    launched ahead past the tokens kept (its tokens discarded) drafted on the reference continuation."""
    seen = [0]

    def execute(inputs):
        outputs = tracker.execute(inputs)
        rows = {tracker.executor.session(s).row: s for s in tracker.seq}
        for row, start, anchor, proposals in backend.drafts[seen[0] :]:
            s = rows[row]
            sequence = tracker.seq[s]
            if start >= len(sequence):
                sequence = sequence + tracker.oracle.continuation(sequence, tracker.sampling[s])[: start + 1 - len(sequence)]
            assert sequence[start] == anchor
            assert proposals == DraftReference(tiny.target, tiny.draft, sequence).proposals(start, tracker.executor.dims.proposals), (row, start)
        seen[0] = len(backend.drafts)
        return outputs

    return execute


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torch-fast", pytest.param("torch-cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("policy", ["alternate", "decode", "adaptive", "lengths"])
def test_outputs_under_any_policy_equal_plain_decoding_and_the_reference(tiny, oracle, backend, policy):
    """Guards against a policy that changes output: decode steps between cycles must keep the draft's
    context exact (the device writes each decode tap at the pending row; a wrong row, a lost tap, or a
    pending count past B would change what the draft sees), a lane switching kind must not lose or
    repeat tokens, and a cycle verifying k < P proposals (``lengths``: forced 3, 3, decode, 7, 3...) must
    verify, emit and keep as context exactly its first k (a verdict over the wrong rows, taps of rows past
    k, or a bonus token at P instead of k would change tokens or the next draft). fp32 outputs, greedy
    and sampled, must equal the target-only reference and a ``speculate=False`` executor's
    (``--no-draft``); every draft call's proposals the reference draft's."""
    policy_object = make_policy(policy, tiny.dims.verify_proposals)
    executor, recording = policy_executor(tiny, backend, policy_object)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(5)]
    t.set_sampling(sessions[3], Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=7))
    workload(t, checked_execute(tiny, t, recording), sessions, 14)
    cycles = executor.cycle_stats()
    assert set(cycles["mode"]) >= {"static", "target"}
    decoded = cycles.filter((pl.col("mode") == "target") & (pl.col("policy") != FIXED)).height
    assert decoded > 0  # drafting lanes really decoded plainly
    verified = cycles.filter(pl.col("mode") != "target")
    assert set(verified["proposed"]) <= set(tiny.dims.verify_proposals) and (verified["accepted"] <= verified["proposed"]).all()
    assert (verified["bonus"] == (verified["accepted"] == verified["proposed"])).all()
    if policy == "lengths":
        assert tiny.dims.verify_proposals == (3, 7) and set(policy_object.lengths) == {3, 7}
        assert set(verified["proposed"]) == {3, 7}
    outputs = [t.seq[s] for s in sessions]
    executor.close()
    plain, _ = policy_executor(tiny, backend, "always")
    p = Tracker(plain, oracle)
    plain_sessions = [p.open(speculate=False) for _ in range(5)]
    p.set_sampling(plain_sessions[3], Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=7))
    workload(p, p.execute, plain_sessions, 14)
    for ours, theirs in zip(outputs, (p.seq[s] for s in plain_sessions)):  # plain steps may get fewer tokens per call
        n = min(len(ours), len(theirs))
        assert ours[:n] == theirs[:n] and n >= 30
    plain.close()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torch-fast"])
def test_forced_verify_lengths_with_oracle_proposals_equal_the_reference(tiny, oracle, backend):
    """Guards against wrong commits of a shorter verify when it accepts (emitted = d_1..d_a + y_a with
    a <= k, the bonus token y_k when all k are accepted, frontier = start + a + 1, context = taps of rows
    0..a): with oracle proposals (wrong at a scrambled offset in 0..P) a policy forced through lengths 3
    and 7 and decode steps sees every acceptance 0..3 at k = 3 and long ones at k = 7; greedy and sampled
    fp32 outputs must equal the target-only reference, the real draft's proposals the reference draft's,
    on ONNX Runtime (the exported _p3 graphs) and the torch backend (eager modules and the fast twin)."""
    policy = make_policy("lengths", tiny.dims.verify_proposals)
    executor, recording = policy_executor(tiny, backend, policy)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(3)]
    sampled = Sampling(temperature=0.8, top_k=0, top_p=0.95, seed=11)
    t.set_sampling(sessions[2], sampled)
    prompts = [[3 + (5 * s + 3 * k) % 80 for k in range(n)] for s, n in zip(sessions, (6, 11, 4))]
    for s, p in zip(sessions, prompts):
        recording.truth[executor.session(s).row] = p + oracle.continuation(p, t.sampling[s])
    execute = checked_execute(tiny, t, recording)
    execute([(s, p, None, True) for s, p in zip(sessions, prompts)])
    for r in range(30):
        live = [s for s in sessions if t.frontier(s) + 1 <= executor.dims.max_context]
        if not live:
            break
        execute([(s, [t.seq[s][-1]], None, True, {"max_new_tokens": 3 + r % 7}) for s in live])
    cycles = executor.cycle_stats().filter(pl.col("mode") != "target")
    short, full = cycles.filter(pl.col("proposed") == 3), cycles.filter(pl.col("proposed") == 7)
    assert set(short["accepted"]) == {0, 1, 2, 3} and short["bonus"].sum() == (short["accepted"] == 3).sum() > 0
    assert full["accepted"].max() > 3 and set(policy.lengths) == {3, 7}
    executor.close()


def test_without_lag_the_policy_switches_every_round_and_stays_lossless(tiny, oracle):
    """Guards against the policy depending on the read-ahead: without ``lag`` every launch is read before
    the lane's next one, so a lane may switch kind every round (never deferred); outputs and every draft
    call's context must still be the reference's."""
    policy = make_policy("alternate", tiny.dims.verify_proposals)
    executor, recording = policy_executor(tiny, "onnxruntime", policy)
    executor.lag = False
    t = Tracker(executor, oracle)
    workload(t, checked_execute(tiny, t, recording), [t.open() for _ in range(3)], 8)
    kinds = [kind for kind, *_ in policy.launches]
    assert kinds.count(CYCLE) > 5 and kinds.count(DECODE) > 5
    executor.close()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch-fast"])
def test_pending_context_rows_equal_a_brute_force_recompute_across_switches(tiny, oracle, backend):
    """Guards against pending-row bookkeeping drifting when a lane switches between decode steps and
    cycles (frontier or draft position off by one, a decode tap written at the wrong index or over a
    pending row, or over a full row set: at the context end the host commits the tap and the device
    must leave the B pending rows alone): after every execute each drafting session's pending rows
    (draft position .. frontier) must be 0..B rows whose taps equal the target's taps at those
    positions, recomputed from scratch."""
    executor, _recording = policy_executor(tiny, backend, make_policy("mixed", tiny.dims.verify_proposals))
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(4)]
    B = executor.dims.block_size
    checks = [0]

    def execute(inputs):
        outputs = t.execute(inputs)
        for s in sessions:
            view = executor.session(s)
            pending = view.frontier - view.draft_position
            assert 0 <= pending <= B, (s, pending)
            committed = t.seq[s][: view.frontier]
            taps = DraftReference(tiny.target, tiny.draft, committed).taps  # [frontier, W]
            got = executor.context.taps[view.row, :pending].float()
            torch.testing.assert_close(got, taps[view.draft_position : view.frontier].float(), atol=1e-4, rtol=1e-4)
            checks[0] += pending > 0
        return outputs

    workload(t, execute, sessions, 60)  # to the context end: decode steps with host taps at full pending rows
    modes = executor.cycle_stats().group_by("policy").agg(pl.col("mode").unique())
    assert {DRAIN, EXPLORE} <= set(modes["policy"])  # switches happened, and full pending rows forced drains
    assert checks[0] > 10
    executor.close()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch-fast"])
def test_a_switch_to_decode_steps_never_waits_for_a_cycle_in_flight(tiny, oracle, backend):
    """Guards against an idle round at every switch from cycles to decode steps: a lane whose cycle was still
    in flight (lag) was held back a round, its pending context count unknown, so the device idled until that
    cycle was read, and a policy's decode probe among cycling lanes launched no decode step at all (500 of
    500 probes at 16 lanes on the host proxy: decode never measured). A cycle verifying k leaves at most
    k + 1 pending rows, so behind one verifying k <= B - 2 the step launches at once; behind one verifying
    P = B - 1 (it may leave B rows: full) the lane cycles once more at the longest such k (``switch``) and
    decodes the round after: a lane waits only where not even that cycle fits (the context's end). Every draft
    call's context and every output stay the reference's, and each drafting session's pending rows equal a
    brute-force recompute after every execute."""
    B, lengths = tiny.dims.block_size, tiny.dims.verify_proposals
    short = max(k for k in lengths if k <= B - 2)
    for length, switches in ((short, False), (tiny.dims.proposals, True)):
        executor, recording = policy_executor(tiny, backend, Scripted([(CYCLE, length), DECODE]))
        held, plan = [0, 0], executor._decode_round

        def counted(policed, choice, asked, plan=plan, executor=executor):
            """The decode round, counting the lanes it held back though a decode step of theirs could launch
            (``held[0]``), and of those, the ones a switch cycle could have served too (``held[1]``)."""
            ready = plan(policed, choice, asked)
            step = executor._shape(DECODE, choice)[1]
            cycle = executor._shape(CYCLE, Choice(CYCLE, SWITCH, proposals=short))[1]
            for lane in policed:
                if lane.deferred:
                    shape = lane.shape
                    lane.shape = step
                    if lane.may_launch():
                        held[0] += 1
                        lane.shape = cycle
                        held[1] += lane.may_launch()
                    lane.shape = shape
            return ready

        executor._decode_round = counted
        t = Tracker(executor, oracle)
        sessions = [t.open() for _ in range(3)]
        checked = checked_execute(tiny, t, recording)

        def execute(inputs, executor=executor, checked=checked, t=t, sessions=sessions):
            outputs = checked(inputs)
            for s in sessions:
                view = executor.session(s)
                pending = view.frontier - view.draft_position
                assert 0 <= pending <= B, (s, pending)
                taps = DraftReference(tiny.target, tiny.draft, t.seq[s][: view.frontier]).taps
                got = executor.context.taps[view.row, :pending].float()
                torch.testing.assert_close(got, taps[view.draft_position : view.frontier].float(), atol=1e-4, rtol=1e-4)
            return outputs

        workload(t, execute, sessions, 10)
        cycles = executor.cycle_stats()
        decodes, switched = cycles.filter(pl.col("mode") == "target"), cycles.filter(pl.col("policy") == SWITCH)
        assert decodes.height > 10 and held[1] == 0 and (switches or held[0] == 0), (length, decodes.height, held)
        assert (switched.height > 0) == switches and set(switched["proposed"]) <= {short}, (length, switched["proposed"].to_list())
        executor.close()


@pytest.mark.parametrize("name", ["decode", "mixed", "adaptive"])
def test_every_policy_decodes_to_the_contexts_end_in_one_call(tiny, oracle, name):
    """Guards against a lane near the context's end being dropped for the rest of an execute under the
    policy's rounds: a full lane whose drain could not launch behind its step in flight, or a cycling lane
    whose next block did not fit behind its cycle in flight, was not offered again once read, so the call
    returned early (17 / 9 / 9 tokens where 18 / 13 / 10 were due under decode choices). With the room for
    it, one call returns every token to the end, the reference's, and each session's draft context (cache
    and pending rows) is the reference's."""
    executor, recording = policy_executor(tiny, "torch-fast", make_policy(name, tiny.dims.verify_proposals))
    L, B = executor.dims.max_context, executor.dims.block_size
    t = Tracker(executor, oracle)
    lengths = [L - B - 9, L - B - 4, L - B - 1, L - B + 1, L - 3, L - B - 12]
    sessions = [t.open() for _ in lengths]
    prompts = [[3 + (11 * k + j) % 80 for j in range(n)] for k, n in enumerate(lengths)]
    outputs = t.execute([(s, p, None, True, {"max_new_tokens": L}) for s, p in zip(sessions, prompts)])
    assert [len(out) for out in outputs] == [L - n + 1 for n in lengths]  # positions n .. L (the last never fed)
    for s in sessions:
        assert_context(tiny, executor, recording, executor.session(s), t.seq[s])


def test_a_missed_decode_probe_is_due_again_the_next_round():
    """Guards against decode never being measured while lanes cycle at P: a decode probe there only switches
    its lanes (their cycles in flight may leave them full), so it ran no decode step; reported missed, it
    must run again at that lane count's next round (and only then: a probe that ran is not repeated), so
    the policy's decode rate stays measured where cycling is the incumbent."""
    policy = AdaptivePolicy(probe_every=1)
    for _ in range(3):
        policy.observe(CYCLE, 4, 0.001, 12)
        policy.observe(DECODE, 4, 0.001, 4)
    choices = [policy.choose(4) for _ in range(20)]
    probes = [i for i, choice in enumerate(choices) if choice.why == PROBE]
    assert probes and all(choices[i].kind == DECODE for i in probes) and all(b - a > 1 for a, b in itertools.pairwise(probes))
    policy.missed(choices[probes[-1]])
    again, after = policy.choose(4), policy.choose(4)
    assert (again.kind, again.why) == (DECODE, PROBE) and after.why == ESTIMATE
    policy.missed(after)  # only probes are ever repeated
    assert policy.choose(4).why == ESTIMATE


def test_choices_are_stats_columns_and_counters(tiny, oracle):
    """Guards against choices that cannot be analysed: every decode row of a drafting lane and every
    cycle row says why it ran (policy, policy_ratio), the per-execute counters count exactly those rows,
    and the always policy's rows say fixed (it never decodes a lane that could cycle)."""
    executor, _ = policy_executor(tiny, "onnxruntime", make_policy("alternate", tiny.dims.verify_proposals))
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(3)] + [t.open(speculate=False)]
    workload(t, t.execute, sessions, 6)
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    chosen = cycles.filter(pl.col("policy") != FIXED)
    assert set(chosen["policy"]) <= {EXPLORE, DRAIN, SWITCH}  # switch: a cycle in flight at P before a decode round
    assert int(executes["policy_cycles"].sum()) == chosen.filter(pl.col("mode") != "target").height > 0
    assert int(executes["policy_decodes"].sum()) == chosen.filter(pl.col("mode") == "target").height > 0
    assert int(executes["policy_verified"].sum()) == int(chosen["proposed"].sum()) > 0  # Σ verify lengths of its cycles
    assert cycles.filter(pl.col("session") == sessions[3])["policy"].unique().to_list() == [FIXED]
    assert cycles.filter(pl.col("policy") == FIXED)["policy_ratio"].is_nan().all()
    executor.close()
    always, _ = policy_executor(tiny, "onnxruntime", "always")
    t = Tracker(always, oracle)
    workload(t, t.execute, [t.open() for _ in range(2)], 4)
    rows = always.cycle_stats()
    assert set(rows.filter(pl.col("mode") != "target")["policy"]) == {FIXED}
    assert set(rows.filter(pl.col("mode") != "target")["proposed"]) == {tiny.dims.proposals}  # always: every cycle verifies P
    assert int(always.execute_stats()["policy_decodes"].sum()) == 0
    always.close()


def test_a_full_pending_context_drains_the_whole_round_in_one_launch(tiny, oracle):
    """Guards against a lane whose pending context rows are full draining apart, in a launch of its own beside
    the others' decode step: lanes fill at different rounds, so under decode choices nearly every round ran
    two launches (10 of 16 lanes per launch on the host proxy at tau 1.6, DFlash at 0.56x plain decoding).
    The round drains every lane in one launch instead: each execute runs exactly as many launches as its
    busiest lane ran rounds (but where a lane is at the context's end: no cycle fits it, it decodes beside a
    draining round), the drains happened, and the outputs are the reference's."""
    policy = make_policy("decode", tiny.dims.verify_proposals)
    executor, _ = policy_executor(tiny, "torch-fast", policy)  # row-indexed: one launch serves any rows
    executor.lag = False  # every launch read before the next: launches and rounds are the same count
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(4)]
    workload(t, t.execute, sessions, 14)  # prompts of 1, 5, 9, 17 tokens: pending rows fill at different rounds
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    assert (cycles["policy"] == DRAIN).sum() > 0
    rounds = cycles.filter(pl.col("batch_id") > cycles["batch_id"].min())  # after the prompts' execute: loop launches only
    busiest = rounds.group_by(["batch_id", "session"]).len().group_by("batch_id").agg(pl.col("len").max())
    ending = rounds.group_by("batch_id").agg((pl.col("position").max() + tiny.dims.block_size > tiny.dims.max_context).alias("ending"))
    launched = executes.select("batch_id", "loop_launches").join(busiest, on="batch_id").join(ending.filter(~pl.col("ending")), on="batch_id")
    assert launched.height > 5 and (launched["loop_launches"] == launched["len"]).all(), launched
    executor.close()


def test_lanes_stop_drafting_where_their_drain_falls_due_when_cycling_loses(tiny, oracle):
    """Guards against DFlash-mode decoding that stays dearer than plain decoding when cycling loses: a
    lane under decode choices must still cycle once every B steps to drain its pending context (13% of
    lane-rounds were such drains on the host proxy at tau 1.6, DFlash 0.90x plain decoding even when decoding
    alone). Under decode choices marked ``stop`` a lane whose drain falls due stops drafting instead:
    no drain ever runs, each stopped session is counted once and decodes as a plain session from then on
    (no cycle of it afterwards, even when a later round chooses cycles), and every output is the
    reference's."""
    policy = make_policy("stopping", tiny.dims.verify_proposals)
    executor, _ = policy_executor(tiny, "torch-fast", policy)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(4)]
    workload(t, t.execute, sessions, 14)
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    stopped = [s for s in sessions if not executor.session(s).speculate]
    assert len(stopped) >= 2 and int(executes["drafting_stopped"].sum()) == len(stopped)
    assert (cycles["policy"] == DRAIN).sum() == 0
    B = tiny.dims.block_size
    for s in stopped:  # its last cycle came before B decode steps in a row: then it stopped, and never cycled again
        rows = cycles.filter(pl.col("session") == s).sort("cycle_id")
        last_cycle = rows.with_row_index().filter(pl.col("mode") != "target")["index"].max()
        assert rows.height - 1 - last_cycle >= B, (s, rows.select("cycle_id", "mode", "policy"))
    executor.close()


def test_rounds_shared_with_plain_lanes_are_not_measured(tiny, oracle):
    """Guards against rates taken from rounds that are neither option: beside a session that does not draft
    (or has stopped), a cycle round launches the drafting lanes apart from the plain lane's decode step, so
    its launch serves fewer lanes than the round's count and cycling looks dearer than it is (under
    ``adaptive-stop`` that locked cycling out once lanes had stopped: 0.84x plain decoding at tau 2.8 on
    the host proxy). Such rounds are not observed, and their lanes never stop drafting; rounds of drafting
    lanes alone are. Outputs are the reference's either way."""
    policy = make_policy("stopping", tiny.dims.verify_proposals)
    executor, _ = policy_executor(tiny, "torch-fast", policy)
    t = Tracker(executor, oracle)
    drafting, plain = [t.open() for _ in range(2)], t.open(speculate=False)
    every = [*drafting, plain]
    t.execute([(s, [3 + s, 5 + s, 7], None, True) for s in every])  # prompts: the drafting lanes' one cycle, alone
    before = len(policy.launches)
    for _ in range(3):  # the plain lane, one token per round, is the last to finish: every policed round has it
        t.execute([(s, [t.seq[s][-1]], None, True, {"max_new_tokens": 8}) for s in every])
    assert len(policy.launches) == before and int(executor.execute_stats()["drafting_stopped"].sum()) == 0
    assert all(executor.session(s).speculate for s in drafting)
    t.execute([(s, [t.seq[s][-1]], None, True, {"max_new_tokens": 8}) for s in drafting])
    assert len(policy.launches) > before  # drafting lanes alone: measured
    executor.close()


def test_a_hopeless_draft_stops_lanes_beside_plain_lanes_too(tiny, oracle):
    """Guards against lanes that keep draining a draft that is never accepted because a plain session shares
    their rounds: such rounds are not measured and a cost estimate stops no one there, but a hopeless draft
    (``Choice.hopeless``) is a fact of the acceptance, not of the round. Each drafting lane stops where its
    drain falls due, no drain runs, and every output is the reference's."""
    policy = make_policy("hopeless", tiny.dims.verify_proposals)
    executor, _ = policy_executor(tiny, "torch-fast", policy)
    t = Tracker(executor, oracle)
    drafting, plain = [t.open() for _ in range(3)], t.open(speculate=False)
    workload(t, t.execute, [*drafting, plain], 14)
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    stopped = [s for s in drafting if not executor.session(s).speculate]
    assert len(stopped) >= 2 and int(executes["drafting_stopped"].sum()) == len(stopped)
    assert (cycles["policy"] == DRAIN).sum() == 0
    executor.close()


def test_the_default_policy_stops_drafting_a_draft_that_is_never_accepted(tiny, oracle):
    """Guards against the default policy (``adaptive``) draining a useless draft for good: the tiny pair's
    draft is never accepted (its proposals are random to the target), so every cycle yields one token at a
    verify's and a draft's cost, and a drafting lane under decode rounds still cycled every B steps to
    drain its pending context. Once the acceptance is hopeless every lane stops drafting where its drain
    falls due (no drain runs), and the outputs are the reference's."""
    policy = policy_named("adaptive", tiny.dims.verify_proposals)
    executor, _ = policy_executor(tiny, "torch-fast", policy)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(4)]
    workload(t, t.execute, sessions, 14)
    assert policy.hopeless() and policy.reached[0].value == 0.0  # the premise: never accepted
    assert all(not executor.session(s).speculate for s in sessions)
    assert int(executor.execute_stats()["drafting_stopped"].sum()) == len(sessions)
    assert (executor.cycle_stats()["policy"] == DRAIN).sum() == 0
    executor.close()


def test_every_launch_is_charged_to_the_round_that_chose_it(tiny, oracle):
    """Guards against launches charged to another round than the one that chose them (the policy could not
    tell a decode round's drain from a cycle round's launch, and rates them differently: a drain feeds only the
    cycles' launch-cost mean): under a decode-only policy every launch of a drafting lane, drain cycles
    included, is charged to a decode round, and the tokens charged are exactly the
    tokens those launches yielded (a + 1 per cycle row, 1 per decode row, a session at the context end
    decoding in the same launch included: it shares the launch's cost)."""
    policy = make_policy("decode", tiny.dims.verify_proposals)
    executor, _ = policy_executor(tiny, "onnxruntime", policy)
    t = Tracker(executor, oracle)
    workload(t, t.execute, [t.open() for _ in range(4)], 12)
    cycles = executor.cycle_stats()
    chosen = cycles.filter(pl.col("policy") != FIXED)
    assert set(chosen["policy"]) == {EXPLORE, DRAIN} and {kind for kind, *_ in policy.launches} == {DECODE}
    charged = cycles.filter(pl.col("cycle_id").is_in(chosen["cycle_id"].implode()))  # every row of those launches
    assert sum(tokens for *_, tokens in policy.launches) == int((charged["accepted"] + 1).sum())
    executor.close()


class Planning(Scripted):
    """``Scripted`` whose every round's plan (``choose``) takes ``plan_s`` of the serving thread."""

    def __init__(self, pattern: list, plan_s: float) -> None:
        super().__init__(pattern)
        self.plan_s, self.plans = plan_s, 0

    def choose(self, owners: int) -> Choice:
        time.sleep(self.plan_s)
        self.plans += 1
        return super().choose(owners)


def test_a_launch_is_charged_the_host_work_between_reads(tiny, oracle):
    """Guards against launch costs that leave out the serving thread's work between two reads (a round's plan,
    admissions, the next round's launches): charged only its own launch call, wait and read, the launches missed
    ~40% of the thread's time on the host proxy at 16 streams, where a cycle's host work per token is the
    smaller, so the policy undervalued cycling where the host is the limit. Here every round's plan takes 30 ms
    beside programs of ~1 ms: the costs the policy receives must hold every plan but the last (after the last
    read), and add up to no more than the execute's wall time (no work charged twice)."""
    policy = Planning([CYCLE, DECODE, CYCLE], 0.03)
    executor, _ = policy_executor(tiny, "onnxruntime", policy)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(3)]
    t.execute([(s, [5 + s, 6, 7, 8], None, True) for s in sessions])
    policy.launches.clear()
    policy.plans = 0
    started = time.perf_counter()
    t.execute([(s, [t.seq[s][-1]], None, True, {"max_new_tokens": 10}) for s in sessions])
    wall = time.perf_counter() - started
    charged = sum(seconds for _, _, seconds, _ in policy.launches)
    assert policy.plans >= 3 and len(policy.launches) >= policy.plans - 1
    assert (policy.plans - 1) * policy.plan_s <= charged <= wall, (policy.plans, charged, wall)
    executor.close()


def test_policy_choices_reach_the_serving_metrics_and_prometheus(tiny, oracle):
    """Guards against choices the operator cannot see: the serving loop's metrics and the server's
    /metrics family dflash_trt_policy_choices_total{choice} must count the drafting lanes' launches
    by kind, dflash_trt_policy_verified_proposals_total the proposals their cycles verified (Σ k
    of a policy forced through lengths 3 and 7), and dflash_trt_drafting_stopped_total the sessions
    that stopped drafting, as the executor's stats count them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dflash_trt.runtime.serving.loop import ServingLoop
    from dflash_trt.server.prometheus import ServingCollector

    executor = Executor(RecordingBackend(tiny.ort), tiny.dims, 4, policy=make_policy("lengths, then stopping", tiny.dims.verify_proposals))
    serving = ServingLoop(executor)
    for prompt in ([5, 6, 7], [9, 10, 11, 12, 13]):
        tokens = serving.submit(prompt, 40).result(60).tokens
        assert tokens == oracle.continuation(prompt)[:40]
    serving.close()  # joins the loop: every execute row is recorded
    executes = executor.execute_stats()
    expected = {"cycle": int(executes["policy_cycles"].sum()), "decode": int(executes["policy_decodes"].sum())}
    assert serving.metrics().policy_choices == expected and min(expected.values()) > 0
    chosen = executor.cycle_stats().filter((pl.col("policy") != FIXED) & (pl.col("mode") != "target"))
    verified = int(chosen["proposed"].sum())
    assert serving.metrics().policy_verified == verified == int(executes["policy_verified"].sum()) and set(chosen["proposed"]) == {3, 7}
    registry = CollectorRegistry()
    registry.register(ServingCollector(serving, "tiny"))
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    samples = {s.labels["choice"]: s.value for f in families for s in f.samples if s.name == "dflash_trt_policy_choices_total"}
    assert samples == expected
    assert [s.value for f in families for s in f.samples if s.name == "dflash_trt_policy_verified_proposals_total"] == [verified]
    stopped = int(executes["drafting_stopped"].sum())
    assert serving.metrics().drafting_stopped == stopped > 0
    assert [s.value for f in families for s in f.samples if s.name == "dflash_trt_drafting_stopped_total"] == [stopped]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 15), st.lists(st.integers(0, 15), min_size=1, max_size=9)), min_size=1, max_size=6))
def test_acceptance_by_position_equals_the_count_per_position(launches):
    """Guards against the histogram form of ``accept`` (suffix sums of the accepted counts) drifting from
    the rule per position: the share of owners with accepted >= i, for i in 1..k of each launch; an
    off-by-one would shift the acceptance curve and so every cycle length's expected tokens."""
    policy = AdaptivePolicy(lengths=LENGTHS)
    reference = [[] for _ in range(15)]  # per position: the shares seen, in order
    for k, accepted in launches:
        accepted = [min(a, k) for a in accepted]
        policy.accept(k, np.array(accepted))
        for i in range(1, k + 1):
            reference[i - 1].append(sum(a >= i for a in accepted) / len(accepted))
    for i, shares in enumerate(reference):
        if shares:
            expected = type(policy.reached[i])(policy.accept_alpha, skip=0, least=1)  # an Ewma fed the same shares
            for share in shares:
                expected.add(share)
            assert policy.reached[i].value == expected.value and policy.reached[i].seen == expected.seen


def test_the_round_plan_counts_the_execute_s_going_lanes_and_drops_only_finished_idle_ones(tiny):
    """Guards against the round plan's count of the execute's going lanes (the owner count the policy is
    asked at) losing a lane it must count as it stops walking finished ones: one lane in this round (bucket
    1), another live one and one finished with a read-ahead still in flight make 3 going lanes (bucket 4,
    where that launch runs), and two finished lanes with nothing in flight count for nothing and are
    dropped for good; the next round asks at the same count."""
    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context)
    executor = Executor(tiny.torch_backend(dims, TINY_ROWS, "fast"), dims, TINY_ROWS)
    sessions = [executor.open_session() for _ in range(5)]
    executor.execute([Input(s, [3 + s, 9, 4, 7], max_new_tokens=1) for s in sessions])  # prompts in, a pending token each
    steps = validate_batch(executor.table, [Input(s, [executor.session(s).pending], max_new_tokens=10) for s in sessions], executor.limits)
    lanes = [executor._lane(step, {}) for step in steps]
    for lane in lanes:
        executor._assign(lane)
    here, live, in_flight, idle, idle_too = lanes
    assert all(lane.policed and lane.may_launch() for lane in lanes)  # the premise: drafting lanes, each may launch
    in_flight.finish = idle.finish = idle_too.finish = LENGTH
    in_flight.flight.append(Flight(CYCLE, lanes[0].shape.width, None))
    asked = []

    class Asked(Scripted):
        def choose(self, owners: int) -> Choice:
            asked.append(owners)
            return super().choose(owners)

    executor.policy = Asked([CYCLE])
    executor._policed, executor._plain = list(lanes), []
    ids = lambda chosen: [id(lane) for lane in chosen]  # noqa: E731  (lanes by identity: dataclass equality compares fields)
    assert ids(executor._plan_round([here])) == [id(here)] and asked == [4]
    assert ids(executor._policed) == ids([here, live, in_flight])
    assert ids(executor._plan_round([here])) == [id(here)] and asked == [4, 4]
    executor.close()
