"""A plain key lease passing from job to job without Redis: the decision both shells share
(pure), and the asyncio shell's parking of leases for the next job of their pool."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harvest.coordination.key_pool import Lease
from harvest.execution import effects as fx
from harvest.execution import handoff


def plain(granted_at: float = 1000.0, token: str = "tok", **kw: Any) -> Lease:
    return Lease("p", 3, token, 5, granted_at + 30.0, granted_at=granted_at, plain=True, **kw)


NONE = handoff.Faults()  # no key answered 429 or was refused


def given_back(lease: Lease, **kw: Any) -> fx.ReleaseKey:
    return fx.ReleaseKey(lease, **{"used": 0, "succeeded": True, **kw})


@pytest.mark.parametrize(
    ("age", "passes"),
    [
        (0.0, True),
        (handoff.PASS_FOR * 0.99, True),
        (handoff.PASS_FOR + 0.001, False),
        (-0.001, False),
    ],
)
def test_a_plain_lease_passes_on_only_while_young_by_the_redis_clock(
    age: float, passes: bool
) -> None:
    """A clock behind Redis's (a negative age) passes nothing: skew makes passing rarer,
    never longer than PASS_FOR after the grant."""
    done = given_back(plain())
    assert handoff.passes_on(done, "p", 0, 1000.0 + age, 30.0, faults=NONE) is passes


def test_a_short_ttl_shortens_how_long_a_lease_passes() -> None:
    done = given_back(plain())
    assert handoff.passes_on(done, "p", 0, 1000.05, 30.0, faults=NONE)
    assert not handoff.passes_on(done, "p", 0, 1000.05, 0.4, faults=NONE)  # 0.4 x 0.2 / 2 = 0.04 s


@pytest.mark.parametrize(
    "done",
    [
        given_back(plain(), succeeded=False),  # a 429, a rejection, an error: the key may cool
        given_back(plain(), used=120),  # a call that counted tokens
        given_back(plain(cost=50)),  # tokens reserved
        given_back(Lease("p", 3, "tok", 5, 1030.0, granted_at=1000.0)),  # a rate, a budget...
    ],
)
def test_a_lease_that_is_not_plain_or_whose_call_went_wrong_goes_back_to_redis(
    done: fx.ReleaseKey,
) -> None:
    assert not handoff.passable(done, 1000.01, 30.0, faults=NONE)


def test_a_lease_passes_only_to_a_job_of_its_pool_that_reserves_no_tokens() -> None:
    done = given_back(plain())
    assert handoff.passes_on(done, "p", 0, 1000.01, 30.0, faults=NONE)
    assert not handoff.passes_on(done, "other", 0, 1000.01, 30.0, faults=NONE)
    assert not handoff.passes_on(done, "p", 10, 1000.01, 30.0, faults=NONE)


def test_a_parked_lease_goes_to_the_next_job_of_its_pool_or_back_to_redis_after_park() -> None:
    """Parked, a lease passes to a job of its pool that asks within PARK (newest first); one
    no job took goes back once PARK is over; a 429 on a key sends back what is parked of it;
    draining sends back the rest."""
    back: list[Lease] = []

    def give_back(done: fx.ReleaseKey) -> None:
        back.append(done.lease)

    async def scenario() -> None:
        import time

        now = time.time()
        loop = asyncio.get_running_loop()
        parking = handoff.Parking(give_back, 30.0, handoff.Faults(), loop.call_later)
        a, b = plain(now), plain(now, token="b")
        c = Lease("p", 4, "c", 6, now + 30, granted_at=now, plain=True)
        parking.park(given_back(a))
        parking.park(given_back(b))
        assert parking.take("other", 0) is None
        assert parking.take("p", 0) is b  # the newest
        assert parking.take("p", 7) is None  # a job that reserves tokens takes none
        await asyncio.sleep(handoff.PARK * 2)
        assert back == [a]  # waited out: back to Redis
        parking.park(given_back(b))
        parking.park(given_back(c))
        parking.drop_key(b)  # its key answered 429: not passed on
        await asyncio.sleep(0)
        assert back == [a, b]
        parking.drain()
        assert back == [a, b, c] and parking.take("p", 0) is None

    asyncio.run(scenario())


def test_a_429_or_a_refusal_in_this_process_stops_the_older_leases_of_its_key_passing() -> None:
    """A lease granted before its key's 429 goes back to Redis (which knows the key cools and
    may have lowered its limits) however young; one granted after the cooldown it began
    passes; while the fault is being written no lease of the key passes; other keys pass on."""
    import time

    faults, t = handoff.Faults(), time.time()
    before, other_key = plain(t), Lease("p", 4, "o", 1, t + 30, granted_at=t, plain=True)
    with faults.writing(before, 30.0) as fault:
        assert not handoff.passes_on(
            given_back(plain(t + 0.5)), "p", 0, t + 0.6, 30.0, faults=faults
        )
        fault.until = t + 0.2  # the cooldown the 429 began ends then (Redis clock)
    assert not handoff.passes_on(given_back(before), "p", 0, t + 0.3, 30.0, faults=faults)
    assert handoff.passes_on(given_back(plain(t + 0.2)), "p", 0, t + 0.3, 30.0, faults=faults)
    assert handoff.passes_on(given_back(other_key), "p", 0, t + 0.3, 30.0, faults=faults)


def test_a_fault_whose_cooldown_end_is_not_known_holds_its_key_back_a_ttl() -> None:
    """A refusal (or a 429 Redis did not answer): every lease of the key granted up to a TTL
    past this process's clock is held back, and the fault is kept even when writing it failed."""
    import time

    faults, now = handoff.Faults(), time.time()
    with pytest.raises(ConnectionError), faults.writing(plain(now), 30.0):
        raise ConnectionError("Redis away")
    assert not handoff.passes_on(
        given_back(plain(now + 0.5)), "p", 0, now + 0.6, 30.0, faults=faults
    )
    assert handoff.passes_on(given_back(plain(now + 31)), "p", 0, now + 31.1, 30.0, faults=faults)
