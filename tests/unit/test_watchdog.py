"""The watchdog thread behind time limits on -P threads and the sync shell's kept-key timer."""

from __future__ import annotations

import threading
import time

from harvest.execution.limits import Watchdog


def test_a_callback_runs_at_its_deadline_unless_cancelled() -> None:
    dog = Watchdog()
    ran: list[str] = []
    done = threading.Event()
    kept = dog.at(time.monotonic() + 0.05, lambda: ran.append("kept"))
    dropped = dog.at(time.monotonic() + 0.05, lambda: ran.append("dropped"))
    dog.at(time.monotonic() + 0.1, done.set)
    dog.cancel(dropped)
    assert done.wait(5)
    assert ran == ["kept"]
    dog.cancel(kept)  # after it ran: nothing to do


def test_cancelling_after_the_callback_ran_keeps_nothing() -> None:
    """A job on -P threads that timed out still cancels its deadline when it returns: over a
    long-lived worker, each of those must not leave its handle behind."""
    dog = Watchdog()
    fired = threading.Semaphore(0)
    handles = [dog.at(time.monotonic(), fired.release) for _ in range(500)]
    for _ in handles:
        assert fired.acquire(timeout=5)
    for handle in handles:
        dog.cancel(handle)
    assert not dog._cancelled and not dog._pending
