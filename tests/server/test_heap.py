"""The server's processes freeze their start-up heap before serving (``command.freeze_heap``)."""

from __future__ import annotations

import gc
import weakref

from dflash_trt.server import command


class Node:
    """A cycle of one: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_freezing_the_heap_keeps_no_garbage_and_later_cycles_are_still_collected():
    """Bug guarded: every full collection walked all that loading made (torch, the backend, the app) while
    every stream waited, a ~60 ms pause on the CPU proxy. What is live at the freeze must leave the
    collector's view, garbage made before it must be freed (not frozen for the process's life), and
    cycles made while serving must still be collected."""
    try:
        dead_before = weakref.ref(Node())
        live = Node()
        frozen = command.freeze_heap()
        assert dead_before() is None
        # What the freeze moved, less any frozen object that died since (a thread an earlier test left may free some).
        assert 0 < gc.get_freeze_count() <= frozen
        assert all(obj is not live for obj in gc.get_objects())  # in the permanent generation: never walked
        dead_after = weakref.ref(Node())
        gc.collect()
        assert dead_after() is None
    finally:
        gc.unfreeze()
    assert any(obj is live for obj in gc.get_objects())
