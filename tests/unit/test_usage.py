"""What a call counts as, and the process's tally (no services)."""

from __future__ import annotations

import threading

from harvest.usage import Tally, call
from harvest.usage.tally import minute_of


def test_a_call_counts_what_was_reported_else_what_was_reserved() -> None:
    assert call("p", 1, reported=120, reserved=600, limited=False, error=False).tokens == 120
    assert call("p", 1, reported=None, reserved=600, limited=False, error=False).tokens == 600
    assert call("p", 1, reported=0, reserved=600, limited=False, error=True).tokens == 0


def test_a_429_is_not_also_an_error() -> None:
    one = call("p", 1, reported=None, reserved=0, limited=True, error=True)
    assert (one.limited, one.error) == (True, False)


def test_calls_add_up_per_minute_and_key_and_take_empties_the_tally() -> None:
    tally = Tally()
    at = 1_700_000_000.0
    for tokens, limited, error in ((100, False, False), (0, True, False), (50, False, True)):
        tally.add(call("p", 2, reported=tokens, reserved=0, limited=limited, error=error), at=at)
    tally.add(call("p", 1, reported=7, reserved=0, limited=False, error=False), at=at + 60)
    taken = tally.take()
    assert taken == [
        ((minute_of(at), "p", 2, ""), (3, 150, 1, 1)),
        ((minute_of(at + 60), "p", 1, ""), (1, 7, 0, 0)),
    ]
    assert len(tally) == 0 and tally.take() == []


def test_rows_put_back_after_a_failed_flush_add_to_new_ones_within_a_bound() -> None:
    tally = Tally(max_rows=2)
    one = call("p", 1, reported=10, reserved=0, limited=False, error=False)
    tally.add(one, at=0.0)
    failed = tally.take()
    tally.add(one, at=30.0)
    tally.merge(failed)
    assert tally.take() == [((0.0, "p", 1, ""), (2, 20, 0, 0))]
    for minute in range(4):
        tally.add(one, at=minute * 60.0)
    assert [b[0] for b, _ in tally.take()] == [120.0, 180.0] and tally.dropped == 2


def test_threads_adding_at_once_lose_nothing() -> None:
    tally = Tally()
    one = call("p", 1, reported=1, reserved=0, limited=False, error=False)

    def add() -> None:
        for _ in range(1000):
            tally.add(one, at=0.0)

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tally.take() == [((0.0, "p", 1, ""), (8000, 8000, 0, 0))]
