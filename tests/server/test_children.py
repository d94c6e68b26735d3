"""The server's view of its child processes from several threads (``server.children``)."""

from __future__ import annotations

import multiprocessing
import threading

from dflash_trt.server.children import ended, exit_code

EXITS_AFTER = "import os, time; time.sleep(0.3); os._exit(3)"  # run by ``exec`` in a spawned child (picklable)


def test_two_threads_waiting_on_one_child_both_see_it_end_with_its_exit_code():
    """Guards against the shutdown race of ``dflash-trt serve``: the front's main thread and its pipe receiver
    (and the fronts' watcher) each joined the same child, i.e. each called ``waitpid``; the loser's call failed
    and ``multiprocessing`` then reported the child, already gone, as running with no exit code, so clean
    exits were logged as hangs ("did not exit ...; killing it"). Both threads must see the child end, with
    the code it exited with, every time."""
    context = multiprocessing.get_context("spawn")  # as the server starts its children
    for _ in range(4):
        child = context.Process(target=exec, args=(EXITS_AFTER,))
        child.start()
        assert not ended(child)  # it sleeps first
        seen = {}

        def other(child=child, seen=seen):
            seen["other"] = (ended(child, 60), exit_code(child))

        thread = threading.Thread(target=other)
        thread.start()
        seen["main"] = (ended(child, 60), exit_code(child))
        thread.join(60)
        assert seen == {"main": (True, 3), "other": (True, 3)}
        assert not child.is_alive() and ended(child)
