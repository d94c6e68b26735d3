"""Speculation that never loses: per round, a plain decode step or a DFlash cycle of one verify length.

Pure math over what the loop measures (no torch); the executor asks for one
``Choice`` per round (the lanes it is about to launch together, ``n`` of
them, padded to ``device_loop.owner_buckets``) and feeds back, per launch,
the kind, verify length and lane count of the round that caused it, its
cost, the lanes it served and the tokens it yielded, and per cycle launch
its owners' accepted counts.

The options of a round of ``n`` lanes: a decode step, or a cycle verifying
the first ``k`` of the draft's P proposals for ``k`` in ``lengths``
(``Dims.verify_proposals``, e.g. 3, 7, 15: the draft always proposes P, a
shorter verify costs fewer target rows). The round runs the option whose
rounds yield the most tokens per second at ``n``; its ``ratio`` is the best
cycle length's over decode's::

    ratio(n) = max_k (tokens / second of k-cycle rounds at n) / (tokens / second of decode rounds at n)

A k-cycle round yields lanes · E_k tokens, E_k = 1 + Σ_{i ≤ k} P(the first i
proposals are accepted) — the accepted proposals and the correction/bonus
token, τ of a k-cycle — so the ratio is E_k · C_decode(n) / C_cycle(k, n)
without other launches. The acceptance by draft position is measured from
every cycle's verdicts (``accept``: a cycle verifying k says whether
d_1..d_i were accepted for i <= k only, nothing past k), as EWMAs per
position; a length whose positions were never verified is rated by its
measured tokens per launch instead, and a length's cost is never taken below
a shorter one's (a superset of the verify rows). Decode rounds are rated by
what their decode steps yielded per launch, which charges them with split
launches and launches whose tokens are discarded (a lane that finished). Not
with their forced drains (lanes whose pending context is full cycle:
``DRAIN``, at the best-rated length): a drain is a cycle of lanes that cycle
whichever kind the round chose, so its cost and tokens rated decode by a
blend of both kinds, near cycling's whenever cycling pays (on the host proxy
15-23% of the lane-rounds decoded where cycles yield twice as much per
device second; benchmarks/RESULTS.md, "The policy's accounting").

Costs are WALL seconds per launch, host work included: a launch is charged
the serving thread's time from the end of the read before it to the end of
its own read (the rounds' planning, admissions, the wait for its verdict,
turning it into tokens, stats and streamed deliveries), less the other
launch calls made meanwhile, plus its own call. Summed over launches they
are the loop's wall time (a prefill's wait aside), so the policy maximizes
what callers receive per second; where the device sets the pace, reads end
as launches do, and each is charged about its own device time. Device time
alone (``runtime.timing``) would miss what a busy serving thread spends per
launch (benchmarks/RESULTS.md, "policy"); a launch's own call, wait and read
alone missed ~40% of it (its planning, the admissions), which undervalued
cycling where the host is the limit. Costs, yields and lanes are kept per
(round kind, padded lane count, verify length) as EWMAs; the first launch of
each key is not counted (it warms up: compiles, captures), and a rate is
known from its second counted launch on. A cost sample counts as at most
``COST_CLIP`` times the mean of launches of its own kind and length at that
lane count: one stalled launch cannot make its round kind look many times
dearer for the hundreds of rounds the probes would need to wear it off, and
on a host whose launches stall often the option run every round and the one
only probed are both rated at their stall-free cost, not the one by its mean
over stalls and the other by its last quiet probe.

While a rate at ``n`` is unknown, the policy explores (runs the unknown
option: the longest cycle first, whose verdicts measure every position, then
decode, then the shorter lengths); once all are known it re-probes each
losing option every ``probe_interval(its rate / the chosen rate)`` rounds at
that count (the most overdue first), so a stale estimate recovers when the
load or the acceptance changes: ``probe_every`` (16) near break-even, doubling
for every 25% the estimate lies away from it, at most 8× (a probe costs in
proportion to the gap, and a far estimate needs a large change to flip).
Hysteresis: the choice at ``n`` switches only when another option's ratio
exceeds the previous one's by ``margin`` (with one cycle length: when the
ratio crosses 1 ± margin), so it does not flap on noise.

``AlwaysCycle`` is the fixed policy (every drafting lane cycles, verifying
P, whenever a block fits), the behaviour before this module existed;
``--no-draft`` stays the baseline without any drafting. ``adaptive-stop``
is ``AdaptivePolicy(stop_drafting=True)``: where cycling loses by estimate,
lanes stop drafting for good instead of draining (``Choice.stop``); rounds
beside plain lanes are not measured (``Choice.measured``). It did not pay on
the H200 (benchmarks/RESULTS.md, "Stopping drafting where cycling loses").

A draft whose first proposal is almost never accepted (``hopeless``: under
``HOPELESS_SHARE`` of at least ``HOPELESS_EVIDENCE`` verified owner-cycles) can
never pay at any load: each cycle yields one token at a verify's and a draft's
cost. There every policy but ``always`` stops a lane's drafting where its drain
falls due under a decode choice (``Choice.hopeless``), beside plain lanes too
(the acceptance decides, not a round's cost), so a useless draft costs what
plain decoding costs plus the first rounds' exploration (on the H200's
Qwen3-8B shape with a random draft: drains and probes cost 6% without this).
Probes keep measuring the acceptance through the lanes still drafting (every
new session drafts until its first drain), so a draft that starts to be
accepted is noticed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

CYCLE, DECODE = "cycle", "decode"  # the kinds (device_loop's program kinds)
# Why a lane ran what it ran: the cycle table's ``policy`` column.
ESTIMATE, EXPLORE, PROBE, DRAIN, SWITCH, FIXED = "estimate", "explore", "probe", "drain", "switch", "fixed"
POLICIES = ("adaptive", "always", "adaptive-stop")  # ``Executor(policy=...)``, ``--policy``


@dataclass(frozen=True)
class Choice:
    """What a lane runs and why: ``kind``; ``why`` (``ESTIMATE``, ``EXPLORE``, ``PROBE``, ``FIXED``, or
    ``DRAIN`` from the executor); the estimated ratio at the decision (NaN while a rate is unknown); the
    round it belongs to (its kind and padded lane count), which its launch's cost is charged to;
    ``proposals``, the verify length of a cycle (of a decode round: the length its drain cycles use;
    0: the executor's P); ``stop``: a decode round chosen by estimate with cycling losing, whose lanes
    stop drafting for good where their drain falls due instead of draining (``AdaptivePolicy.stop_drafting``);
    ``measured``: False (set by the executor) for a round beside plain lanes (sessions that do not draft,
    or stopped): its launches say nothing of what either option's round costs and yields at its count (a
    cycle launch of the few drafting lanes beside the plain lanes' decode step), so they are not
    observed, and its lanes do not stop drafting (only what all-drafting rounds measured stops them);
    ``hopeless``: a decode round (not a probe or an exploration) while the draft's acceptance is hopeless
    (``AdaptivePolicy.hopeless``): its lanes stop drafting where their drain falls due, measured or not."""

    kind: str
    why: str
    ratio: float = math.nan
    round: str = ""
    owners: int = 0
    proposals: int = 0
    stop: bool = False  # see the docstring
    measured: bool = True  # see the docstring
    hopeless: bool = False  # see the docstring


@dataclass
class Ewma:
    """An exponentially weighted mean that ignores its first ``skip`` samples; the plain mean of the
    samples while there are fewer than 1 / alpha, so early samples are not overweighted; ``known``
    from ``least`` samples on. ``clip``: a sample counts as at most ``clip`` times the mean so far, so one
    outlier moves the mean by at most ``weight · (clip - 1)`` of it, while a lasting rise is still followed
    (each sample may raise the mean by that share again).

    A clipped mean (``clip``, or ``add``'s ``ref``: a sample counts as at most ``ref.clip`` times
    ``ref``'s mean) is robust from its first sample on: in the plain-mean phase its samples are kept and
    each is bounded again at every new one (at ``clip`` times the smallest of them, or by ``ref`` as it
    stands then), so a stall among the first few samples, which nothing bounded yet, is cut once the
    others show what a launch costs, instead of weighing a third or a half of the mean until its
    probes, rounds apart, wear it off."""

    alpha: float
    skip: int = 1
    least: int = 2
    value: float | None = None
    seen: int = 0
    clip: float | None = None
    early: list | None = None  # the plain-mean phase's (sample, ref) pairs (a clipped mean only)

    def add(self, sample: float, ref: Ewma | None = None) -> None:
        self.seen += 1
        counted = self.seen - self.skip
        if counted <= 0:
            return
        if counted * self.alpha < 1.0 and (self.clip is not None or ref is not None):
            self._add_early(sample, ref)
            return
        weight = max(self.alpha, 1.0 / counted)
        value = self.value
        if ref is not None:
            sample = ref.clipped(sample)
        if value is None:
            self.value = sample
        else:  # ``clipped``, inline: this runs a dozen times per round
            if self.clip is not None:
                sample = min(sample, self.clip * value)
            self.value = value + weight * (sample - value)

    def _add_early(self, sample: float, ref: Ewma | None) -> None:
        """The plain-mean phase of a clipped mean: every sample so far bounded anew, each by its own ``ref``
        (a decode round's drain cycles by the cycles' mean, its steps by the steps'), or at ``clip`` times
        the smallest sample (see the class docstring)."""
        early = self.early = self.early or []
        early.append((sample, ref))
        if ref is not None:
            self.value = sum(r.clipped(s) for s, r in early) / len(early)
        else:
            bound = self.clip * min(s for s, _ in early)
            self.value = sum(min(s, bound) for s, _ in early) / len(early)

    def clipped(self, sample: float) -> float:
        """``sample`` as ``add`` counts it: at most ``clip`` times the mean so far (as is before a first mean)."""
        return sample if self.value is None or self.clip is None else min(sample, self.clip * self.value)

    @property
    def known(self) -> bool:
        return self.seen - self.skip >= self.least


def _ewma(means: dict, key: tuple, alpha: float, clip: float | None = None) -> Ewma:
    """``means[key]``, made on first use (an ``Ewma`` is built only then: ``observe`` asks four per launch)."""
    mean = means.get(key)
    if mean is None:
        mean = means[key] = Ewma(alpha, clip=clip)
    return mean


def cycle_ratio(cycle_tokens_per_s: float, decode_tokens_per_s: float) -> float:
    """Tokens per second of cycle rounds over that of decode rounds (> 1: cycling pays).

    >>> cycle_ratio(150.0, 200.0)
    0.75
    """
    return cycle_tokens_per_s / decode_tokens_per_s


# A launch's wall cost counts as at most this many times the mean of launches of its own kind and length
# at its lane count: a lone stall (a garbage collection, a page fault, a neighbour's burst on the host)
# inside one launch would otherwise raise its round kind's cost estimate many-fold, and the policy would
# shun that kind until enough probes, each ``probe_interval`` rounds apart, wore the stall off: hundreds of
# rounds of the slower kind. Per launch kind, not per round kind: a decode round's drain cycles cost more
# than its decode steps by nature (they feed the cycles' launch mean, never decode's estimate: ``observe``).
# 1.5, not more: on a host where one launch in ten stalls (a busy neighbour), a looser clip let stalls raise
# the estimate of the option run every round while the option only probed kept its last quiet sample: at 3x
# (and a stall among an option's first samples counted in full: ``Ewma``'s plain-mean phase) 3.5-23% of the
# rounds ran the losing kind by estimate, and once chosen, the other's stale estimate held it there
# (tests/runtime/test_policy.py, ``test_a_host_that_stalls_often_does_not_turn_the_choice``). The price: a
# lasting rise is followed at most alpha x 0.5 = 10% per launch, a 2x rise within ~7 launches.
COST_CLIP = 1.5
HOPELESS_SHARE = 0.05  # ``AdaptivePolicy.hopeless``: the first proposal accepted in fewer than 1 in 20 owner-cycles ...
HOPELESS_EVIDENCE = 16  # ... of at least this many verified (all 16 rejected by chance at an acceptance of 0.3: 0.3%)

PROBE_STEP = 1.25  # each factor of this between the estimate and break-even doubles the probe interval
PROBE_SPREAD = 8  # ... up to this many times ``probe_every``


def probe_interval(probe_every: int, ratio: float) -> int:
    """Rounds between two probes of the losing kind at an estimated cycle / decode ``ratio``.

    >>> [probe_interval(16, r) for r in (1.0, 0.9, 0.75, 0.5, 0.39, 1.5, 4.0)]
    [16, 16, 32, 128, 128, 32, 128]
    """
    steps = int(abs(math.log(ratio)) / math.log(PROBE_STEP)) if ratio > 0 else PROBE_SPREAD
    return probe_every * min(PROBE_SPREAD, 2**steps)


Option = tuple[str, int]  # (kind, verify length): (CYCLE, k), or (DECODE, 0); (CYCLE, 0) is the executor's P


def _best_cycle(values: dict[Option, float]) -> float:
    """The best cycle length's value among an owner count's options (``AdaptivePolicy._values``)."""
    return max(v for (kind, _), v in values.items() if kind == CYCLE)


def _best_length(scores: dict[Option, float | None]) -> int | None:
    """The cycle length of the best known score (rates, or their values), the longer on a tie; None if none is known."""
    known = [(score, k) for (kind, k), score in scores.items() if kind == CYCLE and score is not None]
    return max(known)[1] if known else None


@dataclass
class AdaptivePolicy:
    """Decode, or a cycle of one of ``lengths``, per round, from measured costs and yields (see the module docstring)."""

    alpha: float = 0.2  # EWMA weight of a new launch
    margin: float = 0.05  # hysteresis: switch when the ratio crosses 1 ± margin
    probe_every: int = 16  # rounds at one lane count between probes of the losing kind, near break-even
    lengths: tuple[int, ...] = ()  # the verify lengths offered (ascending, the last P); (): one, the executor's
    accept_alpha: float = 0.02  # EWMA weight of a new cycle launch in the acceptance by draft position
    stop_drafting: bool = False  # decode chosen by estimate, cycling losing: ``Choice.stop`` (``adaptive-stop``)
    hopeless_share: float = HOPELESS_SHARE  # ``hopeless``
    hopeless_evidence: int = HOPELESS_EVIDENCE
    verified: int = 0  # owner-cycles whose first proposal was verified (``accept``)
    costs: dict[tuple[str, int, int], Ewma] = field(default_factory=dict)  # (round kind, owners, length) -> seconds per launch
    yields: dict[tuple[str, int, int], Ewma] = field(default_factory=dict)  # ... -> tokens per launch
    lanes: dict[tuple[str, int, int], Ewma] = field(default_factory=dict)  # ... -> lanes served per launch
    launch_costs: dict[tuple[str, int, int], Ewma] = field(default_factory=dict)  # (LAUNCH kind, owners, length) -> seconds: COST_CLIP's mean
    reached: list[Ewma] = field(default_factory=list)  # [i - 1]: share of verified owner-cycles accepting d_1..d_i
    last: dict[int, Option] = field(default_factory=dict)  # owners -> the option chosen last
    idle: dict[tuple[int, Option], int] = field(default_factory=dict)  # (owners, option) -> rounds since it ran
    # Each length's expected tokens (1 + the running sums of the leading known positions' acceptance values),
    # until the next ``accept``: ``expected`` is asked for every cycle length at every round's choice.
    _known: list[float] | None = field(default=None, repr=False, compare=False)
    # (lengths, options(), the options in tie order: decode, then the cycles shortest first), made once per lengths
    _options: tuple = field(default=(None, (), ()), repr=False, compare=False)

    def options(self) -> tuple[Option, ...]:
        """Every option, in exploration order: the longest cycle first (its verdicts measure acceptance
        at every position), then decode, then the shorter cycles (made once per ``lengths``: asked
        several times per round)."""
        return self._made()[1]

    def _made(self) -> tuple:
        """``_options``, remade when ``lengths`` changed."""
        if self._options[0] is not self.lengths:
            cycles = [(CYCLE, k) for k in reversed(self.lengths)] or [(CYCLE, 0)]
            self._options = (self.lengths, (cycles[0], (DECODE, 0), *cycles[1:]), ((DECODE, 0), *reversed(cycles)))
        return self._options

    def observe(
        self, kind: str, owners: int, seconds: float, tokens: int, lanes: int | None = None, proposals: int = 0, launch: str | None = None
    ) -> None:
        """One launch of a round of ``kind`` (a cycle round verifying ``proposals``) at ``owners`` (padded)
        lanes took ``seconds`` of wall time, served ``lanes`` lanes whose tokens were kept (default:
        ``owners``) and yielded ``tokens`` (0 for one whose tokens were all discarded); ``launch``: the
        launch's own kind (default ``kind``; a decode round's drain cycles are ``CYCLE`` launches verifying
        ``proposals``), whose mean bounds the sample (``COST_CLIP``); a drain feeds only that mean."""
        key = (kind, owners, proposals if kind == CYCLE else 0)
        launch = launch or kind
        usual = _ewma(self.launch_costs, (launch, owners, proposals if launch == CYCLE else 0), self.alpha, COST_CLIP)
        usual.add(seconds)  # first: its (clipped) mean, this launch included, bounds the round's sample
        if kind == DECODE and launch == CYCLE:
            return  # a decode round's drain is a cycle (of lanes that cycle under either choice): decode is rated by its plain steps
        _ewma(self.costs, key, self.alpha).add(seconds, ref=usual)
        _ewma(self.yields, key, self.alpha).add(tokens)
        _ewma(self.lanes, key, self.alpha).add(owners if lanes is None else lanes)

    def accept(self, proposals: int, accepted: Sequence[int] | np.ndarray) -> None:
        """One cycle launch verifying ``proposals`` accepted ``accepted`` (one count per owner, each in
        0..proposals): the acceptance by draft position, at the positions it verified (1..proposals)."""
        if not len(accepted):
            return
        while len(self.reached) < proposals:
            self.reached.append(Ewma(self.accept_alpha, skip=0, least=1))
        # Owners that reached position i (accepted >= i), every i in one pass: a histogram's suffix sums
        # (in Python: a launch has a few dozen owners and ≤ 15 positions, below what array calls cost).
        counts = [0] * (proposals + 1)
        for a in accepted:
            counts[a] += 1
        self._known = None
        owners = reached = len(accepted)
        self.verified += owners
        for i in range(1, proposals + 1):
            reached -= counts[i - 1]  # owners with a >= i
            self.reached[i - 1].add(reached / owners)

    def expected(self, proposals: int) -> float | None:
        """E[tokens per owner] of a cycle verifying ``proposals`` from the acceptance seen so far: 1 + Σ_{i ≤ k}
        P(a ≥ i), ``reached[i - 1]`` being P(the first i proposals are accepted) (the correction or bonus token
        counts); None until every position 1..proposals has been verified.

        >>> policy = AdaptivePolicy()
        >>> policy.accept(4, [4, 2, 1, 0])  # the first positions' shares: 0.75, 0.5, 0.25, 0.25
        >>> policy.expected(2), policy.expected(5)
        (2.25, None)
        """
        if self._known is None:
            self._known, total = [], 0.0
            for r in self.reached:  # the leading known positions
                if not r.known:
                    break
                total += r.value
                self._known.append(1.0 + total)
        return self._known[proposals - 1] if 0 < proposals <= len(self._known) else None

    def rate(self, kind: str, owners: int, proposals: int = 0) -> float | None:
        """Tokens per second of rounds of ``kind`` (cycles verifying ``proposals``) at ``owners``; None
        until ``Ewma.known``. A cycle round's tokens per launch are its lanes times the expected tokens
        of that length (``expected``) once the acceptance at its positions is known, else as measured;
        its cost is ``_cycle_cost``."""
        key = (kind, owners, proposals if kind == CYCLE else 0)
        cost, tokens = self.costs.get(key), self.yields.get(key)
        if cost is None or not cost.known or cost.value <= 0:
            return None
        expected = self.expected(proposals) if kind == CYCLE else None
        if expected is None:
            return tokens.value / cost.value
        return self.lanes[key].value * expected / self._cycle_cost(owners, proposals)

    def _cycle_cost(self, owners: int, proposals: int) -> float:
        """A k-cycle's cost per launch, never below a shorter length's: the same draft and a superset of
        the verify rows cost no less, so a noisy low sample cannot make a longer verify look cheaper."""
        costs = self.costs
        most = costs[(CYCLE, owners, proposals)].value
        for k in self.lengths:
            if k < proposals and (cost := costs.get((CYCLE, owners, k))) is not None and cost.known and cost.value > most:
                most = cost.value
        return most

    def ratio(self, owners: int) -> float | None:
        """The best cycle length's tokens per second over decode rounds' at ``owners``; None while any
        option's rate is unknown."""
        values = self._values(owners)
        return None if values is None else _best_cycle(values)

    def _values(self, owners: int) -> dict[Option, float] | None:
        """Each option's rate over the decode rate (decode: 1); None while any is unknown."""
        decode = self.rate(DECODE, owners)
        if decode is None or decode <= 0:
            return None
        values = {}
        for option in self.options():  # asked every round: stops at the first unknown rate
            rate = decode if option[0] == DECODE else self.rate(CYCLE, owners, option[1])
            if rate is None:
                return None
            values[option] = cycle_ratio(rate, decode)
        return values

    def choose(self, owners: int) -> Choice:
        """The kind (and verify length) of the round at ``owners`` (padded) lanes."""
        values = self._values(owners)
        if values is None:
            unknown = [o for o in self.options() if self.rate(o[0], owners, o[1]) is None]
            kind, k = unknown[0] if unknown else (DECODE, 0)  # all known but decode yields nothing: re-measure it
            return Choice(kind, EXPLORE, math.nan, kind, owners, k if kind == CYCLE else self._drain_length(owners))
        chosen = self._keep_or_switch(owners, values)
        ratio = values[chosen] if chosen[0] == CYCLE else _best_cycle(values)
        probe = self._due(owners, chosen, values)
        kind, k = probe or chosen
        length = k if kind == CYCLE else _best_length(values)  # a decode round's drains: ``_drain_length``, from the values in hand
        stop = self.stop_drafting and probe is None and kind == DECODE and ratio < 1.0
        hopeless = probe is None and kind == DECODE and self.hopeless()
        return Choice(kind, PROBE if probe else ESTIMATE, ratio, kind, owners, length, stop, hopeless=hopeless)

    def missed(self, choice: Choice) -> None:
        """A probe whose round ran none of its kind (a decode probe among lanes whose cycles in flight may
        leave them full: they cycle once more first, ``SWITCH``): due again at that count's next round, so
        what it was for is measured.

        >>> policy = AdaptivePolicy(probe_every=1)
        >>> for _ in range(3):
        ...     policy.observe(CYCLE, 4, 0.001, 12); policy.observe(DECODE, 4, 0.001, 4)
        >>> whys = [policy.choose(4).why for _ in range(9)]  # cycling wins 3:1; decode is probed every 8 rounds
        >>> whys.count(PROBE), whys[-1]
        (1, 'probe')
        >>> policy.missed(Choice(DECODE, PROBE, 1 / 3, DECODE, 4)); policy.choose(4).why  # it ran no decode step
        'probe'
        >>> policy.choose(4).why  # a probe that ran is not repeated
        'estimate'
        """
        if choice.why == PROBE:
            option = (CYCLE, choice.proposals) if choice.kind == CYCLE else (DECODE, 0)
            self.idle[(choice.owners, option)] = self.probe_every * PROBE_SPREAD + 1  # past any interval

    def hopeless(self) -> bool:
        """Whether the draft's first proposal was accepted in under ``hopeless_share`` of the owner-cycles
        verified, once ``hopeless_evidence`` were: then no verify length can pay at any lane count (a
        cycle yields ~1 token, a decode step 1 at less cost), whatever the costs measured so far say.

        >>> policy = AdaptivePolicy()
        >>> policy.accept(15, [0] * 8); policy.hopeless()  # too few owner-cycles to tell
        False
        >>> policy.accept(15, [0] * 8); policy.hopeless()
        True
        """
        return self.verified >= self.hopeless_evidence and bool(self.reached) and self.reached[0].value < self.hopeless_share

    def _keep_or_switch(self, owners: int, values: dict[Option, float]) -> Option:
        """Hysteresis: the best option, unless the previous one is within ``margin`` (in ratio units) of it."""
        best = max(self._made()[2], key=values.__getitem__)  # ties: decode, then shorter cycles
        previous = self.last.get(owners)
        chosen = previous if previous in values and values[best] <= values[previous] + self.margin else best
        self.last[owners] = chosen
        return chosen

    def _due(self, owners: int, chosen: Option, values: dict[Option, float]) -> Option | None:
        """The losing option most overdue for a probe (``probe_interval`` from its ratio to the chosen
        one's), if any: it runs this round, so a stale estimate recovers."""
        due = []
        for option in self.options():
            if option == chosen:
                continue
            idle = self.idle[(owners, option)] = self.idle.get((owners, option), 0) + 1
            if idle <= self.probe_every:  # not due at any ratio (the interval is probe_every at least): no log to take
                continue
            interval = probe_interval(self.probe_every, values[option] / values[chosen])
            if idle > interval:
                due.append((idle / interval, option))
        self.idle[(owners, chosen)] = 0
        if not due:
            return None
        probe = max(due)[1]
        self.idle[(owners, probe)] = 0
        return probe

    def _drain_length(self, owners: int) -> int:
        """The verify length of a decode round's drain cycles: the best-rated known cycle length, else the longest."""
        best = _best_length({(kind, k): self.rate(kind, owners, k) for kind, k in self.options() if kind == CYCLE})
        return best if best is not None else (self.lengths[-1] if self.lengths else 0)


@dataclass
class AlwaysCycle:
    """The fixed policy: every drafting lane cycles whenever a block fits."""

    def observe(
        self, kind: str, owners: int, seconds: float, tokens: int, lanes: int | None = None, proposals: int = 0, launch: str | None = None
    ) -> None:
        pass

    def choose(self, owners: int) -> Choice:
        return Choice(CYCLE, FIXED, math.nan, CYCLE, owners)  # proposals 0: the executor's P


def make_policy(name: str, lengths: tuple[int, ...] = ()) -> AdaptivePolicy | AlwaysCycle:
    """The policy named ``name`` (one of ``POLICIES``); ``lengths``: the verify lengths it may choose
    among (``Dims.verify_proposals``; ``always`` cycles at P). ``adaptive-stop`` is ``adaptive`` whose
    decode estimates with cycling losing also stop drafting (``Choice.stop``): a session that stops never
    drafts again, so an early or passing estimate costs it its speedup for good."""
    if name == "always":
        return AlwaysCycle()
    return AdaptivePolicy(lengths=tuple(lengths), stop_drafting=name == "adaptive-stop")
