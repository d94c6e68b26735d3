"""Launch planning on literal values and fakes (runtime/launches.py): what may launch, what a lane keeps, the scheduler."""

from __future__ import annotations

from dflash_trt.runtime.launches import LoopShape, may_launch, take
from dflash_trt.runtime.finish import LENGTH, STOP

SHAPE = LoopShape(width=4, need=8, max_context=40, max_cycles=3)  # cycles of P+1 = 4, blocks of 8


def test_may_launch_bounds_the_cycle_in_flight_by_its_worst_case():
    """Guards against launching a cycle that could write past the cache (judged from the last READ
    frontier while one cycle is still in flight), one that no room is left for, or more than max_cycles."""
    assert may_launch(32, 0, 0, 10, False, SHAPE)  # 32 + 8 <= 40
    assert not may_launch(33, 0, 0, 10, False, SHAPE)
    assert may_launch(28, 1, 1, 10, False, SHAPE)  # the unread cycle may end at 32
    assert not may_launch(29, 1, 1, 10, False, SHAPE)
    assert not may_launch(0, 1, 1, 1, False, SHAPE)  # the unread cycle yields >= 1 token: no room left
    assert may_launch(0, 1, 1, 2, False, SHAPE)
    assert not may_launch(0, 0, 3, 10, False, SHAPE)  # max_cycles
    assert not may_launch(0, 0, 0, 10, True, SHAPE)  # finished (stop token seen)
    assert may_launch(0, 0, 0, None, False, SHAPE) and not may_launch(0, 0, 1, None, False, SHAPE)  # one step


def test_take_cuts_at_room_and_first_stop():
    """Guards against returning tokens past max_new_tokens or past a stop token (or dropping the stop)."""
    assert take([5, 7, 9], 10, {7}) == ((5, 7), STOP)
    assert take([5, 7, 9], 2, set()) == ((5, 7), LENGTH)
    assert take([5, 7, 9], 3, set()) == ((5, 7, 9), LENGTH)
    assert take([5, 7, 9], 4, {1}) == ((5, 7, 9), None)
    assert take([5, 7], None, set()) == ((5, 7), None)
    assert take([7, 7], 5, {7}) == ((7,), STOP)
    assert take([7], 1, {7}) == ((7,), STOP)  # a stop token that also fills the room: stop


# ------------------------------------------------------------------ the scheduler, with fakes

from itertools import pairwise  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from dflash_trt.runtime.launches import Group, Lane, run_launches  # noqa: E402


def fake_lane(row: int, room: int | None, frontier: int = 0, stop: frozenset = frozenset()) -> Lane:
    session = SimpleNamespace(row=row, frontier=frontier)
    step = SimpleNamespace(room=room, stop=stop)
    return Lane(step, session, anchor=0, first_position=frontier, kind="cycle", shape=SHAPE)


class FakeDevice:
    """Launches record which lanes ran; a read emits ``per_launch`` tokens per lane (token = its row * 100 + k)."""

    def __init__(self, per_launch: int = 2) -> None:
        self.per_launch, self.log, self.in_flight_peak = per_launch, [], 0

    def pack(self, lanes):  # consecutive rows, as a row-bound backend packs them
        groups, run = [], []
        for lane in sorted(lanes, key=lambda lane: lane.session.row):
            if run and lane.session.row != run[-1].session.row + 1:
                groups.append(Group("cycle", False, run))
                run = []
            run.append(lane)
        return groups + ([Group("cycle", False, run)] if run else [])

    def launch(self, group):
        self.log.append(("launch", tuple(group.rows)))
        self.in_flight_peak = max(self.in_flight_peak, max(lane.in_flight for lane in group.lanes) + 1)
        return len(self.log)

    def read(self, group, handle):
        self.log.append(("read", tuple(group.rows)))
        for lane in group.lanes:
            tokens = [lane.session.row * 100 + lane.session.frontier + k for k in range(self.per_launch)]
            lane.session.frontier += self.per_launch
            lane.add(tokens)


@pytest.mark.parametrize("lag", [True, False])
def test_a_finished_lane_leaves_its_group_and_the_others_go_on(lag):
    """Guards against a burst that ends when one lane finishes: a one-step lane (room None) and a lane
    with a small room shared a group with a lane of room 10; the group stopped after their last launch,
    so the long lane's tokens depended on its neighbours."""
    device = FakeDevice()
    long, one_step, short = fake_lane(0, 10), fake_lane(1, None), fake_lane(2, 3)
    run_launches([long, one_step, short], device.pack, device.launch, device.read, lag)
    assert len(long.tokens) == 6 and long.launched == SHAPE.max_cycles  # 3 launches x 2 tokens: max_cycles ends it
    assert one_step.launched == 1 and one_step.tokens == [100, 101] and not one_step.finished
    assert short.tokens == [200, 201, 202] and short.finish == "length"
    assert all(lane.in_flight == 0 for lane in (long, one_step, short))
    launches = [rows for event, rows in device.log if event == "launch"]
    assert launches[0] == (0, 1, 2) and (0,) in launches  # the long lane went on alone
    reads = [rows for event, rows in device.log if event == "read"]
    assert reads == launches  # reads in launch order


def test_lag_keeps_one_launch_in_flight_per_lane():
    """Guards against the host reading each cycle before launching the next (the device idles between
    cycles) and against more than one unread launch per lane (a ring entry or record reused too early)."""
    device = FakeDevice(per_launch=1)
    lane = fake_lane(0, 10)
    run_launches([lane], device.pack, device.launch, device.read, lag=True)
    assert [event for event, _ in device.log[:3]] == ["launch", "launch", "read"]
    assert device.in_flight_peak == 2 and lane.launched == SHAPE.max_cycles


@pytest.mark.parametrize("lag", [2, 3])
def test_a_deeper_lag_keeps_that_many_launches_queued_per_lane(lag):
    """Guards against ``lag`` > 1 acting as 1 (the device still idles through a slow host round) and
    against a lane holding more than lag + 1 unread launches (the ring sized for lag + 1 per row would
    reuse an entry still unread); the lane still runs exactly max_cycles launches."""
    device = FakeDevice(per_launch=1)
    lane = fake_lane(0, 20)
    lane.shape = LoopShape(width=4, need=8, max_context=400, max_cycles=12)
    run_launches([lane], device.pack, device.launch, device.read, lag=lag)
    assert [event for event, _ in device.log[: lag + 2]] == ["launch"] * (lag + 1) + ["read"]
    assert device.in_flight_peak == lag + 1 and lane.launched == 12 and lane.tokens == list(range(12))


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_a_lane_joining_a_running_loop_launches_with_the_others_at_any_lag(lag):
    """Guards against a deeper lag splitting the lanes into groups of their own (a lane that joined tops
    itself up alone, then stays a launch out of phase: twice the launches, half the owners each, measured on
    the H200 as a quarter fewer tokens per second) and against a joined lane running fewer rounds than the
    others. Lanes 0-2 start, lane 3 joins at the second round: every launch from then on holds all of
    them, each lane keeps at most lag + 1 launches unread and runs max_cycles."""
    device = FakeDevice(per_launch=1)
    shape = LoopShape(width=4, need=8, max_context=400, max_cycles=10)
    lanes = [fake_lane(row, 40) for row in range(3)]
    joining = fake_lane(3, 40)
    for lane in (*lanes, joining):
        lane.shape = shape
    asked = []

    def admit(candidates):
        asked.append(len(asked))
        return [joining] if len(asked) == 1 else []

    run_launches(lanes, device.pack, device.launch, device.read, lag=lag, admit=admit)
    launches = [rows for event, rows in device.log if event == "launch"]
    joined = launches.index((0, 1, 2, 3))
    assert all(rows == (0, 1, 2, 3) for rows in launches[joined : joined + 10 - lag])  # one group while all run
    assert all(lane.launched == 10 and len(lane.tokens) == 10 for lane in (*lanes, joining))
    assert device.in_flight_peak == lag + 1


def test_a_lane_stops_before_the_cache_end_even_with_a_launch_in_flight():
    """Guards against launching a cycle that could write past max_context while the previous one is unread."""
    device = FakeDevice(per_launch=4)  # each cycle moves the frontier by width = 4
    lane = fake_lane(0, 100, frontier=26)
    run_launches([lane], device.pack, device.launch, device.read, lag=True)
    # 26 + 8 <= 40; with the first in flight 26 + 4 + 8 <= 40; after it is read 30 + 4 + 8 > 40
    assert lane.launched == 2 and lane.session.frontier == 34


@pytest.mark.parametrize("lag", [True, False])
def test_a_stop_request_ends_the_call_after_its_round_and_reads_what_is_in_flight(lag):
    """Guards against a server's queued request waiting a whole execute (up to max_cycles rounds) for a
    session when it asked to end early, and against an early end that drops launches in flight (tokens
    computed but never read) or that launches nothing at all (a call that makes no progress)."""
    asked = []

    def stop() -> bool:
        asked.append(True)
        return len(asked) > 1  # the second question onwards: stop

    device = FakeDevice()
    lanes = [fake_lane(0, 20), fake_lane(1, 20)]
    run_launches(lanes, device.pack, device.launch, device.read, lag, stop=stop)
    launches = [entry for entry in device.log if entry[0] == "launch"]
    reads = [entry for entry in device.log if entry[0] == "read"]
    assert len(launches) == len(reads) and all(lane.in_flight == 0 for lane in lanes)  # everything launched was read
    assert 1 <= len(launches) <= 2 and all(lane.tokens for lane in lanes)  # the first round, at most one more asked-for
    device = FakeDevice()
    run_launches(lanes := [fake_lane(0, 20), fake_lane(1, 20)], device.pack, device.launch, device.read, lag, stop=lambda: True)
    assert [entry[0] for entry in device.log] == ["launch", "read"] and all(len(lane.tokens) == 2 for lane in lanes)
    device = FakeDevice()
    run_launches(lanes := [fake_lane(0, 20), fake_lane(1, 20)], device.pack, device.launch, device.read, lag, stop=lambda: False)
    assert all(lane.launched == SHAPE.max_cycles for lane in lanes)  # never asked to stop: every round runs


# ------------------------------------------------------------------ several rounds per launch

from dflash_trt.runtime.launches import launch_rounds  # noqa: E402


def test_launch_rounds_runs_several_only_where_each_round_fits_and_is_wanted():
    """Guards against a launch of several rounds whose later rounds could write past the cache (each
    round's start judged in the worst case), run past max_cycles, or run where the room cannot take a
    token from each (a round surely discarded); and against refusing rounds where all of them fit."""
    shape = LoopShape(width=4, need=8, max_context=40, max_cycles=6)
    assert launch_rounds(0, 0, 0, 0, 10, shape, 3) == 3
    assert launch_rounds(24, 0, 0, 0, 10, shape, 3) == 3  # the last round starts at <= 32: 32 + 8 <= 40
    assert launch_rounds(25, 0, 0, 0, 10, shape, 3) == 1
    assert launch_rounds(20, 2, 4, 2, 10, shape, 3) == 3  # 20 + 4 in flight + 8 + 8 <= 40
    assert launch_rounds(21, 2, 4, 2, 10, shape, 3) == 1
    assert launch_rounds(0, 0, 0, 3, 10, shape, 3) == 3 and launch_rounds(0, 0, 0, 4, 10, shape, 3) == 1  # max_cycles
    assert launch_rounds(0, 2, 8, 0, 5, shape, 3) == 3 and launch_rounds(0, 2, 8, 0, 4, shape, 3) == 1  # room after in-flight
    assert launch_rounds(0, 0, 0, 0, None, shape, 3) == 1  # one step only
    assert launch_rounds(0, 0, 0, 0, 10, shape, 1) == 1


class RoundsDevice(FakeDevice):
    """A ``FakeDevice`` whose launches run each lane's ``rounds`` (at most ``most``), ``per_launch`` tokens a round."""

    def __init__(self, most: int) -> None:
        super().__init__(per_launch=2)
        self.most = most

    def pack(self, lanes):
        for lane in lanes:
            lane.rounds = lane.most_rounds(self.most)
        groups = []
        for rounds in sorted({lane.rounds for lane in lanes}):
            for group in super().pack([lane for lane in lanes if lane.rounds == rounds]):
                group.rounds = rounds
                groups.append(group)
        return groups

    def read(self, group, handle):
        for _ in range(group.rounds):
            super().read(group, handle)
        self.log[-group.rounds :] = [("read", tuple(group.rows))]


@pytest.mark.parametrize("lag", [True, False])
def test_several_rounds_per_launch_return_the_tokens_of_one_round_launches(lag):
    """Guards against tokens per call that depend on the rounds per launch (rounds counted as launches
    against max_cycles and room) and against a lane's unread rounds left out of its worst-case reach."""
    results = {}
    for most in (1, 3):
        device = RoundsDevice(most)
        lanes = [fake_lane(0, 20), fake_lane(1, None), fake_lane(2, 5), fake_lane(3, 40, frontier=10)]
        run_launches(lanes, device.pack, device.launch, device.read, lag)
        results[most] = [(lane.tokens, lane.finish, lane.launched, lane.session.frontier) for lane in lanes]
        launches = len([entry for entry in device.log if entry[0] == "launch"])
        assert all(lane.in_flight == 0 for lane in lanes)
        results[most, "launches"] = launches
    assert results[1] == results[3]
    assert results[3, "launches"] < results[1, "launches"]


def test_a_round_of_two_kinds_goes_on_as_one_round_and_a_joining_lane_joins_it():
    """Guards against a round's groups drifting apart (lag 1): a round packed into a cycle group and a decode
    group (a lane near the context's end decodes beside the others' cycles) relaunched each group at its own
    read, so a session admitted where a cycling lane finished joined the decode group's next round and
    launched alone, a cycle group of one for the rest of its life (on the host proxy with requests running
    to the context's end: 6.5 lanes per launch where 15 ran before). Lanes 0 and 1 cycle, lane 2 decodes;
    lane 1 finishes after two launches and lane 3 joins in its place: every later cycle of lane 0 holds
    lane 3 too (lane 3, joined late, runs its last rounds alone), and each of a round's launches goes out
    just before the read of the group launched a round earlier (a read waits for one launch)."""
    device = FakeDevice(per_launch=1)
    shape = LoopShape(width=4, need=8, max_context=400, max_cycles=8)
    cycling, finishing, decoding, joining = fake_lane(0, 40), fake_lane(1, 2), fake_lane(2, 40), fake_lane(3, 40)
    for lane in (cycling, finishing, decoding, joining):
        lane.shape = shape
    decoding.kind = "decode"

    def pack(lanes):  # any rows (a row-indexed backend): one group per kind
        kinds = {}
        for lane in lanes:
            kinds.setdefault(lane.kind, []).append(lane)
        return [Group(kind, False, sorted(members, key=lambda lane: lane.session.row)) for kind, members in sorted(kinds.items())]

    def admit(candidates):
        if finishing.finished and not joining.launched and joining not in candidates:
            return [joining]
        return []

    run_launches([cycling, finishing, decoding], pack, device.launch, device.read, lag=1, admit=admit)
    launches = [rows for event, rows in device.log if event == "launch"]
    assert joining.launched == 8 and cycling.launched == 8 and decoding.launched == 8 and finishing.tokens == [100, 101]
    last = max(i for i, rows in enumerate(launches) if 0 in rows)
    assert (3,) not in launches[:last]  # while lane 0 cycles, the joining lane never launches alone
    first = launches.index((0, 3))
    assert launches[first : last + 2] == [(0, 3), (2,)] * 5  # one cycle group, one decode group a round
    # Past the first round's two launches, a read waits for one launch, never for a whole round's (where
    # a launch computes, on the CPU, the first group's tokens would wait for the second group's program).
    events = [event for event, _ in device.log]
    assert events[:4] == ["launch", "launch", "launch", "read"]
    assert not any(a == b == "launch" for a, b in pairwise(events[2:]))
