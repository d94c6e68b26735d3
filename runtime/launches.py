"""Launch planning: several cycles per execute, the host one cycle behind the device.

An execute hands the device loop *lanes* (one per session that decodes in
this call) packed into *groups* (owners at consecutive rows, one program per
launch). ``run_bursts`` launches every group's first cycle, then for each
launch in order: launches the group's NEXT cycle (when ``lag``), then reads
this one's verdict, so the device is already busy with cycle k+1 while the
host turns cycle k into tokens. Whether a next cycle may start is decided
from what has been read (``may_launch``: room, stops, the cache's end
in the worst case of the cycle still in flight); a lane that finishes while
its group's next cycle is in flight has that cycle's tokens discarded, and
the executor rewinds the session to its last kept token (``Lane.keep_until``).
Without ``lag`` every cycle is read before the next one of its group starts;
the outputs are the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_trt.runtime.device_loop import Key
from dflash_trt.runtime.sessions import Session, Step


@dataclass(frozen=True)
class LoopShape:
    """How far one launch can move an owner: ``width`` positions at most (P+1 for a cycle,
    1 for a decode step); it needs ``need`` free slots at its start (B, or 1)."""

    width: int
    need: int
    max_context: int
    max_cycles: int


def may_launch(frontier: int, in_flight: int, launched: int, room: int | None, finished: bool, shape: LoopShape) -> bool:
    """May one more cycle be launched for an owner whose last READ frontier is ``frontier``?

    ``in_flight`` cycles are launched but unread, ``launched`` in all this
    execute. ``room``: tokens the owner may still return (None: one cycle
    only). The new cycle starts at most ``in_flight * width`` past the frontier
    and must fit the cache; each unread cycle yields at least one token.
    """
    if finished or launched >= shape.max_cycles:
        return False
    if room is None:
        return launched == 0
    fits = frontier + in_flight * shape.width + shape.need <= shape.max_context
    return fits and room > in_flight


def take(tokens: Sequence[int], room: int | None, stop: frozenset[int] | set[int]) -> tuple[tuple[int, ...], bool]:
    """The prefix of ``tokens`` an owner keeps, and whether it is finished.

    At most ``room`` tokens (None: no limit), through the first stop token
    (kept). Finished: a stop token was kept or the room is used up.

    >>> take([5, 7, 9], 10, {7})
    ((5, 7), True)
    """
    kept: list[int] = []
    for token in tokens:
        if room is not None and len(kept) == room:
            return tuple(kept), True
        kept.append(int(token))
        if token in stop:
            return tuple(kept), True
    return tuple(kept), room is not None and len(kept) == room



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
    tokens: list[int] = field(default_factory=list)  # kept: returned by execute
    finished: bool = False
    max_launches: int | None = None  # None: the executor's limit

    @property
    def room(self) -> int | None:
        """Tokens this lane may still return (None: one step, as the seed's executor)."""
        return None if self.step.room is None else self.step.room - len(self.tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """A read cycle's tokens: keep what room and stop tokens allow (nothing once finished)."""
        if self.finished:
            return
        kept, self.finished = take(tokens, self.room, self.step.stop)
        self.tokens += kept

    @property
    def keep_until(self) -> int:
        """Position of the last kept token: the session's frontier once extra tokens are discarded."""
        return self.first_position + len(self.tokens) - 1


@dataclass
class Group:
    """Lanes at consecutive rows sharing one program per launch."""

    kind: str  # loop.CYCLE or loop.DECODE
    sampled: bool
    first: int
    lanes: list[Lane]
    shape: LoopShape
    launched: int = 0
    in_flight: int = 0

    @property
    def key(self) -> Key:
        return Key(self.kind, self.sampled, len(self.lanes), self.first)

    def may_launch(self) -> bool:
        """Every lane wants (and fits) one more launch, judged from what has been read."""
        return all(
            may_launch(lane.session.frontier, self.in_flight, self.launched, lane.room, lane.finished, self._shape(lane))
            for lane in self.lanes
        )

    def _shape(self, lane: Lane) -> LoopShape:
        if lane.max_launches is None:
            return self.shape
        return LoopShape(self.shape.width, self.shape.need, self.shape.max_context, min(lane.max_launches, self.shape.max_cycles))


def run_bursts(groups: Sequence[Group], launch: Callable, read: Callable, lag: bool) -> None:
    """Launch and read every group's cycles until none may launch (see the module docstring).

    ``launch(group, slot)`` enqueues one cycle and returns its handle;
    ``read(group, handle)`` waits for it and applies its verdict to the lanes.
    Reads happen in launch order.
    """
    queue: deque = deque()

    def start(group: Group) -> None:
        queue.append((group, launch(group, group.launched % 2)))
        group.launched += 1
        group.in_flight += 1

    for group in groups:
        if group.may_launch():
            start(group)
    while queue:
        group, handle = queue.popleft()
        if lag and group.may_launch():
            start(group)
        read(group, handle)
        group.in_flight -= 1
        if not lag and group.may_launch():
            start(group)
