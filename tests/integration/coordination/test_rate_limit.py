"""parse_rate and the global sliding-window rate limiter against real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from harvest.coordination.rate_limit import Rate, RateLimiter, parse_rate
from harvest.errors import HarvestError, RateLimited


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("60/m", Rate(60, 60.0)),
        ("5/s", Rate(5, 1.0)),
        ("1000/h", Rate(1000, 3600.0)),
        ("10/2s", Rate(10, 2.0)),
        (" 3 / 5m ", Rate(3, 300.0)),
        ("1/0.5s", Rate(1, 0.5)),
        ("7/d", Rate(7, 86400.0)),
    ],
)
def test_parse_rate(text: str, expected: Rate) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "5",
        "5/",
        "/s",
        "0/s",
        "5/0s",
        "-1/s",
        "5/x",
        "5/s/s",
        "5.5/s",
        "5/ms",
        "1/0.0001s",
    ],
)
def test_parse_rate_names_the_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="invalid rate") as info:
        parse_rate(text)
    assert repr(text) in str(info.value)


def test_rate_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="count"):
        Rate(0, 1.0)
    for period in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="period"):
            Rate(1, period)


def test_admits_n_then_raises_with_retry_after(redis_client: redis.Redis) -> None:
    limiter = RateLimiter(redis_client, "api", "3/s")
    assert [limiter.acquire() for _ in range(3)] == [True, True, True]
    with pytest.raises(RateLimited) as info:
        limiter.acquire()
    assert isinstance(info.value, HarvestError)
    assert 0.5 < info.value.retry_after <= 1.0
    assert "'api'" in str(info.value)
    assert limiter.acquire(raise_on_failure=False) is False


def test_window_slides_one_permit_at_a_time(redis_client: redis.Redis) -> None:
    limiter = RateLimiter(redis_client, "api", Rate(3, 0.6))
    for _ in range(3):
        assert limiter.acquire()
        time.sleep(0.15)
    with pytest.raises(RateLimited) as info:
        limiter.acquire()
    assert info.value.retry_after <= 0.6 - 0.3
    time.sleep(info.value.retry_after + 0.01)
    assert limiter.acquire(), "the oldest call left the window"
    assert not limiter.acquire(raise_on_failure=False), "the two others are still inside it"


def test_limiters_share_a_window_by_name_only(redis_client: redis.Redis) -> None:
    a1 = RateLimiter(redis_client, "a", "2/m")
    a2 = RateLimiter(redis_client, "a", "2/m")
    b = RateLimiter(redis_client, "b", "2/m")
    assert a1.acquire() and a2.acquire()
    assert not a1.acquire(raise_on_failure=False)
    assert not a2.acquire(raise_on_failure=False)
    assert b.acquire()


def test_wait_blocks_until_refill_or_timeout(redis_client: redis.Redis) -> None:
    limiter = RateLimiter(redis_client, "api", Rate(1, 0.3))
    assert limiter.wait(1.0)
    started = time.monotonic()
    assert limiter.wait(1.0)
    assert 0.2 < time.monotonic() - started < 0.8
    started = time.monotonic()
    assert not limiter.wait(0.05)
    assert time.monotonic() - started < 0.3


def test_never_more_than_n_in_any_window_under_contention(redis_client: redis.Redis) -> None:
    """Eight threads hammer a 5-per-0.25s limiter; a fixed window would let 10 through at once."""
    rate = Rate(5, 0.25)
    grants: list[tuple[float, float]] = []
    lock = threading.Lock()
    stop = time.time() + 2.0

    def hammer() -> None:
        client = redis.Redis(connection_pool=redis_client.connection_pool)
        limiter = RateLimiter(client, "hot", rate)
        while time.time() < stop:
            before = time.time()
            if limiter.acquire(raise_on_failure=False):
                with lock:
                    grants.append((before, time.time()))

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    # Each grant happened (on the Redis clock, the same as this machine's) between its
    # before/after stamps; grants wholly inside any span shorter than the period are <= N.
    for start, _ in grants:
        inside = [g for g in grants if g[0] >= start and g[1] < start + rate.period_seconds]
        assert len(inside) <= rate.count, inside
    assert 2.0 / rate.period_seconds * rate.count * 0.5 <= len(grants) <= 9 * rate.count
