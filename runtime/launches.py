"""Launch planning: several cycles per execute, the host one cycle behind the device.

An execute hands the device loop *lanes* (one per session that decodes in
this call). Each launch runs one program for a *group* of lanes (``pack``
makes them: owners at consecutive rows for backends that bind row ranges,
any rows for row-indexed ones). ``run_launches`` launches every group, then
for each round in order: plans the NEXT round of its groups' lanes that may
go on (when ``lag``) and reads its launches' verdicts, launching the next
round's groups between those reads, so the device is already busy with cycle
k+1 while the host turns cycle k into tokens.

``lag`` launches a lane may keep beyond the one being read: 0 reads every
launch before the next, 1 (the default) keeps the device one launch ahead,
2 keeps two (the host's uneven rounds, an admission's or a delivery tick's,
then eat into a queued launch instead of leaving the device idle).

Launching is decided per lane, from what has been read (``may_launch``:
room, stops, the cache's end in the worst case of the cycle still in
flight): a lane that finishes leaves its group and the others go on, re-packed
into smaller groups, so how many tokens an input gets from one execute never
depends on which other inputs share it. A lane that finishes while its next
cycle is in flight has that cycle's tokens discarded, and the executor
rewinds the session to its last kept token (``Lane.keep_until``). Without
``lag`` every cycle is read before the lane's next one starts; the outputs
are the same.

A launch may run several *rounds* (``Lane.rounds``, set by ``pack``: its
program runs its kind that many times back to back on the device, one read
applying each round's verdict in turn). The host's work per launch (the
round's plan, the launch, the read's wait and streaming) is then paid once
per ``rounds`` rounds; ``launch_rounds`` says how many a lane's next launch
may run without writing past the cache, running past ``max_cycles`` or
running a round whose token could not be kept. Rounds count against
``max_cycles`` and ``launched`` as launches of one round do, so how many
tokens an input gets from one execute does not depend on the rounds per
launch; a lane that finishes inside a launch has its later rounds' tokens
discarded like a read-ahead launch's. (On the H200 more than one round per
launch did not pay: the host's work there follows the lanes' rounds, not the
launches; the executor's default is one.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dflash_trt.runtime.finish import LENGTH, STOP
from dflash_trt.runtime.sessions import Session, Step


@dataclass(frozen=True)
class LoopShape:
    """How far one launch can move an owner: ``width`` positions at most (P+1 for a cycle,
    1 for a decode step); it needs ``need`` free slots at its start (B, or 1)."""

    width: int
    need: int
    max_context: int
    max_cycles: int


def may_launch(
    frontier: int, in_flight: int, launched: int, room: int | None, finished: bool, shape: LoopShape, reach: int | None = None,
    spent: int = 0,
) -> bool:
    """May one more cycle be launched for an owner whose last READ frontier is ``frontier``?

    ``in_flight`` rounds are launched but unread, ``launched`` in all this
    execute. ``room``: tokens the owner may still return (None: one cycle
    only). The new cycle starts at most ``reach`` past the frontier (default
    ``in_flight * width``; the sum of the unread launches' widths when their
    kinds or rounds differ) and must fit the cache; each unread round yields at
    least one token. ``spent``: rounds the execute ran before the owner joined it (``run_launches``' admit):
    they count against ``max_cycles``, so an execute ends within max_cycles rounds whoever joins it.
    """
    if finished or launched + spent >= shape.max_cycles:
        return False
    if room is None:
        return launched == 0
    reach = in_flight * shape.width if reach is None else reach
    fits = frontier + reach + shape.need <= shape.max_context
    return fits and room > in_flight


def launch_rounds(
    frontier: int, least: int, reach: int, launched: int, room: int | None, shape: LoopShape, most: int, shared: bool = False
) -> int:
    """How many rounds (``most``, else 1) the next launch of a lane that ``may_launch`` runs.

    ``least``: tokens its unread launches yield at least (one per round), ``reach``: how far they may
    move it, ``launched``: rounds launched (and spent) this execute, ``room`` as in ``may_launch``. All
    ``most`` rounds run only when each one's start fits the cache in the worst case, they stay within
    ``max_cycles``, and the room takes a token from each (else a round would surely be discarded).
    ``shared``: the launch runs ``most`` rounds for other lanes anyway; a round this lane's room cannot
    use costs only device work there (its tokens are discarded, as a read-ahead launch's are), where a
    launch of its own would cost the host a launch and a read more: only the cache and ``max_cycles`` decide.

    >>> shape = LoopShape(4, 8, 40, 32)
    >>> launch_rounds(0, 0, 0, 0, 10, shape, 2), launch_rounds(0, 0, 0, 0, 1, shape, 2), launch_rounds(0, 0, 0, 0, 1, shape, 2, shared=True)
    (2, 1, 2)
    """
    if most == 1 or room is None:
        return 1
    fits = frontier + reach + (most - 1) * shape.width + shape.need <= shape.max_context
    return most if fits and launched + most <= shape.max_cycles and (shared or room - least >= most) else 1


def take(tokens: Sequence[int], room: int | None, stop: frozenset[int] | set[int]) -> tuple[tuple[int, ...], str | None]:
    """The prefix of ``tokens`` an owner keeps, and why it finished (None: it has not).

    At most ``room`` tokens (None: no limit), through the first stop token
    (kept): finished with ``STOP`` when a stop token was kept, ``LENGTH`` when
    the room is used up.

    >>> take([5, 7, 9], 10, {7})
    ((5, 7), 'stop')
    """
    kept: list[int] = []
    for token in tokens:
        if room is not None and len(kept) == room:
            return tuple(kept), LENGTH
        kept.append(int(token))
        if token in stop:
            return tuple(kept), STOP
    return tuple(kept), LENGTH if room is not None and len(kept) == room else None


class Flight(NamedTuple):
    """One launched, unread program of a lane: its kind, how far it may move the lane (``LoopShape.width``),
    and why it was chosen (a ``runtime.policy.Choice``; None without a policy). A tuple: one is made per
    lane per launch, and a frozen dataclass costs several times more to build."""

    kind: str
    width: int  # of all its rounds
    choice: object = None
    rounds: int = 1


@dataclass
class Lane:
    """One session's decoding in this execute.

    ``anchor`` is the token AT the session's frontier (fed first);
    ``first_position`` the position of the first token this lane returns.
    """

    step: Step
    session: Session
    anchor: int
    first_position: int
    kind: str = ""  # device_loop.CYCLE or DECODE: which program serves its next launch
    proposals: int = 0  # a cycle's verify length (one of Dims.verify_proposals); 0 for a decode step
    shape: LoopShape | None = None
    choice: object = None  # why its next launch is of that kind (``runtime.policy.Choice``; None: fixed)
    policed: bool = False  # a drafting lane whose kind the executor's policy picks per round
    deferred: bool = False  # ``choose`` held its launch until its unread launch is read
    tokens: list[int] = field(default_factory=list)  # kept: returned by execute
    streamed: int = 0  # of ``tokens``, handed to the execute's on_tokens already
    finish: str | None = None  # STOP / LENGTH once finished
    decodes: bool = True  # the loop runs it (False: its prompt's prediction was all it gets this call)
    first_pending: bool = False  # its first token (a batched prefill's) is on the device, not read yet
    continues: bool = False  # its input decodes on from a pending token: its first tokens continue an output under way
    launched: int = 0  # rounds launched this execute
    rounds: int = 1  # its next launch's rounds (``pack`` sets it: ``launch_rounds``)
    spent: int = 0  # rounds the execute had run when the lane joined it (``run_launches``' admit)
    flight: deque = field(default_factory=deque)  # [Flight] launched, not read yet, oldest first

    @property
    def in_flight(self) -> int:
        return len(self.flight)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def add(self, tokens: Sequence[int]) -> int:
        """A read cycle's tokens: keep what room and stop tokens allow (nothing once finished); returns
        how many were kept."""
        if self.finish is not None:
            return 0
        budget = self.step.room  # the room left, computed inline (this runs per lane per launch): the step's room
        room = None if budget is None else budget - len(self.tokens)  # minus the tokens kept; None: one step
        if (room is None or len(tokens) < room) and self.step.stop.isdisjoint(tokens):
            self.tokens += tokens  # the common case, without a look at each token (ints already)
            return len(tokens)
        kept, self.finish = take(tokens, room, self.step.stop)
        self.tokens += kept
        return len(kept)

    @property
    def keep_until(self) -> int:
        """Position of the last kept token: the session's frontier once extra tokens are discarded."""
        return self.first_position + len(self.tokens) - 1

    def _unread(self) -> tuple[int, int]:
        """(tokens its unread launches yield at least, how far they may move it)."""
        flight = self.flight
        if not flight:
            return 0, 0
        if len(flight) == 1:
            return flight[0].rounds, flight[0].width
        return sum(f.rounds for f in flight), sum(f.width for f in flight)

    def _room(self) -> int | None:
        budget = self.step.room
        return None if budget is None else budget - len(self.tokens) - self.first_pending

    def may_launch(self) -> bool:
        """One more launch fits and is wanted, judged from what has been read (asked per lane per round)."""
        least, reach = self._unread()
        return may_launch(self.session.frontier, least, self.launched, self._room(), self.finish is not None, self.shape, reach, self.spent)

    def most_rounds(self, most: int, shared: bool = False) -> int:
        """The rounds its next launch may run (``launch_rounds``), ``most`` at best; asked of a lane that may launch."""
        least, reach = self._unread()
        return launch_rounds(self.session.frontier, least, reach, self.launched + self.spent, self._room(), self.shape, most, shared)


@dataclass
class Group:
    """Lanes of one kind (and verify length) sharing one program per launch (``sampled``: any lane samples)."""

    kind: str
    sampled: bool
    lanes: list[Lane]
    proposals: int = 0  # the cycle's verify length; 0 for a decode step
    rounds: int = 1  # its lanes' ``rounds``: the program runs its kind that many times

    @property
    def rows(self) -> list[int]:
        return [lane.session.row for lane in self.lanes]


def run_launches(
    lanes: Sequence[Lane], pack: Callable, launch: Callable, read: Callable, lag: int, choose: Callable | None = None,
    stop: Callable[[], bool] | None = None, admit: Callable[[Sequence[Lane]], Sequence[Lane]] | None = None,
) -> None:
    """Launch and read every lane's cycles until none may launch, or until ``stop()`` (asked before each
    launch after the first round) says to end early: the launches in flight are still read (see the
    module docstring). ``admit(candidates)``, asked next (unless stopping), returns lanes joining the
    running loop: they launch with this launch's candidates, and are read and relaunched like the others.

    ``choose(lanes)`` -> the lanes of one round that launch now (those whose
    ``may_launch`` holds), each one's
    ``kind``, ``shape`` and ``choice`` set for its next launch (a lane it
    leaves out with ``deferred`` set is offered again once its unread launch
    is read, in the next round launched, so deferred lanes rejoin a group
    instead of launching alone; default: every lane keeps its kind);
    ``pack(lanes)`` -> the groups one launch each serves (lanes of one kind, verify length and rounds,
    each lane's ``rounds`` set);
    ``launch(group)`` enqueues one program and returns its handle;
    ``read(group, handle)`` waits for it and applies its verdict to the lanes
    (the launch read is ``lane.flight[0]`` while it runs).
    Reads happen in launch order. ``lag`` (0, 1, 2, ..): before a launch is read, the next round is
    launched for its lanes (lag 1), or for every lane of the execute with fewer than ``lag`` launches
    unread beyond its next read (lag > 1: all of them in one round, so lanes that joined late keep the
    others' groups), as ``may_launch`` allows. At lag 1 the groups one round launched (kinds, verify
    lengths) go on as one round: the next round of all their lanes is planned (``choose``, ``pack``)
    before the first of them is read; its first group is launched then, each later one right after the
    read before it, so a read waits for one launch (on the CPU a launch computes). Relaunched group by
    group, a round's groups drifted apart, and a lane admitted where another finished joined whichever
    group came next, alone if that group's lanes were of another kind.
    """
    queue: deque = deque()  # (group, handle, round): the round is the ``start`` call that launched the group
    planned: deque = deque()  # (group, round): a round's groups after its first, launched one per read (``start``)
    rounds_started = 0

    def start(candidates: Sequence[Lane], may_stop: bool = True, one: bool = False) -> None:
        """One round for ``candidates`` and, unless ``may_stop`` is False, the lanes ``admit`` adds (none
        once ``stop()`` says to end). ``one``: launch its first group only, the others into ``planned``."""
        nonlocal rounds_started
        if may_stop and stop is not None and stop():
            return
        if may_stop and admit is not None and (joined := admit(candidates)):
            candidates = [*candidates, *joined]
            if lag > 1:
                every.extend(joined)
        live = [lane for lane in candidates if lane.finish is None]
        if choose is None:
            chosen = [lane for lane in live if lane.may_launch()]
        else:
            chosen = choose(live) if live else []  # asks may_launch itself, under the kinds it sets
        rounds_started += 1
        assert not planned, "a round starts once the last one's groups are all launched"
        for i, group in enumerate(pack(chosen)):
            if one and i:  # the round's later groups: launched one per read (the loop below)
                planned.append((group, rounds_started))
            else:
                queue.append((group, launch(group), rounds_started))
            flight, rounds = None, group.rounds  # one Flight per (width, choice) run of the group's lanes: they mostly share it
            for lane in group.lanes:
                lane.launched += rounds
                if flight is None or flight.choice is not lane.choice or flight.width != lane.shape.width * rounds:
                    flight = Flight(group.kind, lane.shape.width * rounds, lane.choice, rounds)
                lane.flight.append(flight)

    def launch_planned() -> None:
        group, round_ = planned.popleft()
        queue.append((group, launch(group), round_))

    every = list(lanes) if lag > 1 else []  # lag > 1: the execute's lanes still decoding, joined ones added (``start``)

    def short() -> list[Lane]:
        """lag > 1: every live lane with fewer than lag launches beyond its next read, as one round: a
        lane that joined or skipped a round launches with the others, never in a group of its own."""
        every[:] = [lane for lane in every if lane.finish is None]
        return [lane for lane in every if len(lane.flight) <= lag and not lane.deferred]

    start(lanes, may_stop=False)  # the first round always runs: every call makes progress
    for _ in range(lag - 1):  # lag > 1: the first rounds queued back to back
        start(short(), may_stop=False)
    waiting: list[Lane] = []  # deferred lanes, read since: they join the next round (one group, not one of their own)
    while queue:
        group, handle, launched = queue.popleft()
        groups = [(group, handle)]
        if lag == 1:  # the groups one round launched (its kinds, verify lengths) go on as one round
            while queue and queue[0][2] == launched:
                groups.append(queue.popleft()[:2])
            start([*(lane for g, _ in groups for lane in g.lanes), *waiting], one=True)
            waiting = []
        elif lag > 1:
            start(short())  # read deferred lanes are among short()'s
        for group, handle in groups:
            read(group, handle)
            for lane in group.lanes:
                lane.flight.popleft()
            if not lag:
                start(group.lanes)
                continue
            for lane in group.lanes:
                if lane.deferred and not lane.flight:
                    lane.deferred = False
                    if lag == 1:
                        waiting.append(lane)
            if planned:  # the round's next group after this read: where launching computes (the CPU), a read waits for one launch, not the round's
                launch_planned()
        while planned:
            launch_planned()
        if lag and not queue:  # nothing else in flight: no round to join
            start(waiting if lag == 1 else short())
            waiting = []
