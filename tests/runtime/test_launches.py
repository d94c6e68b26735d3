"""Launch planning on literal values and fakes (runtime/launches.py): what may launch, what a lane keeps, the scheduler."""

from __future__ import annotations

from dflash_trt.runtime.launches import LoopShape, may_launch, take

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
    assert take([5, 7, 9], 10, {7}) == ((5, 7), True)
    assert take([5, 7, 9], 2, set()) == ((5, 7), True)
    assert take([5, 7, 9], 3, set()) == ((5, 7, 9), True)
    assert take([5, 7, 9], 4, {1}) == ((5, 7, 9), False)
    assert take([5, 7], None, set()) == ((5, 7), False)
    assert take([7, 7], 5, {7}) == ((7,), True)
