"""The async loop's room (harvest.execution.loop.Room): Celery's thread waits for room for a
message's jobs, and is woken only once they fit."""

from __future__ import annotations

import threading
import time

from harvest.execution.loop import Room


def test_a_waiting_message_gets_its_room_once_it_fits_and_is_woken_only_then() -> None:
    room = Room(4)
    assert room.take(4, timeout=0.1)
    woken: list[float] = []
    real = room._cond.notify_all

    def counted() -> None:
        woken.append(time.monotonic())
        real()

    room._cond.notify_all = counted  # type: ignore[method-assign]
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(room.take(2, timeout=5.0)))
    waiter.start()
    time.sleep(0.1)
    room.give(1)  # 1 place free: a message of 2 does not fit yet
    time.sleep(0.1)
    assert got == [] and woken == []
    room.give(1)
    waiter.join(2.0)
    assert got == [True] and len(woken) == 1
    assert room.in_use == 4


def test_a_message_larger_than_the_room_waits_for_an_empty_loop_and_close_ends_the_wait() -> None:
    room = Room(2)
    assert room.take(1, timeout=0.1)
    assert room.take(5, timeout=0.05) is False  # only an empty loop takes it
    room.give(1)
    assert room.take(5, timeout=0.05) is True
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(room.take(1, timeout=5.0)))
    waiter.start()
    time.sleep(0.05)
    room.close()
    waiter.join(2.0)
    assert got == [False]


def test_a_message_is_handed_over_as_room_frees_never_beyond_the_room() -> None:
    room = Room(4)
    assert room.take_some(3, timeout=0.1) == 3
    assert room.take_some(5, timeout=0.1) == 1  # what fits now, not the message
    assert room.in_use == 4
    assert room.take_some(5, timeout=0.05) == 0  # full: nothing until a place frees
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(room.take_some(5, timeout=5.0)))
    waiter.start()
    time.sleep(0.05)
    room.give(2)
    waiter.join(2.0)
    assert got == [2] and room.in_use == 4
    room.close()
    assert room.take_some(1, timeout=1.0) == 0
