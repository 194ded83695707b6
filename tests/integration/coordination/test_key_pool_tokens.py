"""Token budgets of the key pool against real Redis: reservations at the lease, in the same
script as concurrency and rate; settlement at the release; no refund for a dead holder."""

from __future__ import annotations

import time

import pytest
import redis

from harvest.coordination import keys
from harvest.coordination.key_pool import Busy, KeyPool, KeySpec, Lease
from harvest.coordination.rate_limit import Rate


def make_pool(client: redis.Redis, *specs: KeySpec) -> KeyPool:
    pool = KeyPool(client, "llm")
    pool.sync(list(specs))
    return pool


def lease_ok(pool: KeyPool, cost: int, ttl: float = 30.0) -> Lease:
    result = pool.lease("w", ttl, cost=cost)
    assert isinstance(result, Lease), f"expected a lease, got {result}"
    return result


def busy(pool: KeyPool, cost: int) -> Busy:
    result = pool.lease("w", 30.0, cost=cost)
    assert isinstance(result, Busy), f"expected Busy, got {result}"
    return result


def spent(pool: KeyPool, key_id: int = 1) -> int:
    return next(s.tokens_used for s in pool.snapshot() if s.key_id == key_id)


def test_reservations_never_pass_the_token_window(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 100, tokens=Rate(1000, 60.0)))
    held = [lease_ok(pool, 300) for _ in range(3)]
    assert spent(pool) == 900
    retry = busy(pool, 300).retry_after  # 1200 > 1000, though concurrency has room
    assert 59.0 < retry <= 60.0, "room comes back when the first reservation leaves the window"
    assert lease_ok(pool, 100).cost == 100  # a smaller call still fits exactly
    busy(pool, 1)
    assert all(pool.release(lease) for lease in held)  # nothing reported: charged as reserved
    assert spent(pool) == 1000


def test_release_refunds_or_charges_what_the_call_used(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 100, tokens=Rate(1000, 60.0)))
    first = lease_ok(pool, 800)
    busy(pool, 800)
    assert pool.release(first, used=150)  # refunded 650
    assert spent(pool) == 150
    second = lease_ok(pool, 800)
    assert pool.release(second, used=850)  # charged 50 more than reserved
    assert spent(pool) == 1000
    busy(pool, 1)


def test_a_dead_holder_keeps_its_reservation(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 100, tokens=Rate(1000, 60.0)))
    dead = lease_ok(pool, 700, ttl=0.2)
    time.sleep(0.3)  # its lease expired: the holder is presumed dead
    busy(pool, 700)  # its concurrency slot is back, its tokens are not
    assert not pool.release(dead, used=10)  # a late release refunds nothing
    assert spent(pool) == 700
    late = lease_ok(pool, 200, ttl=0.2)
    time.sleep(0.3)
    assert not pool.release(late, used=250)  # ... but what it used beyond is still charged
    assert spent(pool) == 950


def test_tokens_slide_out_of_the_window(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 10, tokens=Rate(100, 0.5)))
    pool.release(lease_ok(pool, 60), used=60)
    time.sleep(0.2)
    pool.release(lease_ok(pool, 40), used=40)
    retry = busy(pool, 50).retry_after
    assert 0.2 < retry <= 0.3 + 0.01, "the first call's 60 tokens free first"
    time.sleep(retry + 0.01)
    lease_ok(pool, 50)
    busy(pool, 50)  # only the first call left the window


def test_calls_without_a_cost_are_not_checked_but_charged(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 10, tokens=Rate(100, 60.0)))
    lease = lease_ok(pool, 0)
    pool.release(lease, used=100)  # charged from now at release
    assert spent(pool) == 100
    busy(pool, 1)
    pool.release(lease_ok(pool, 0))  # no cost declared: no token check


def test_tokens_rate_and_concurrency_are_one_decision(redis_client: redis.Redis) -> None:
    pool = make_pool(
        redis_client,
        KeySpec(1, 1, tokens=Rate(1000, 60.0)),
        KeySpec(2, 5, Rate(1, 60.0), tokens=Rate(1000, 60.0)),
        KeySpec(3, 5, tokens=Rate(100, 60.0)),
    )
    got = pool.lease_many("w", 30.0, 5, cost=500)
    assert isinstance(got, list)
    # key 1: one (concurrency); key 2: one (rate); key 3: none (budget below the cost)
    assert sorted(lease.key_id for lease in got) == [1, 2]
    assert spent(pool, 1) == spent(pool, 2) == 500 and spent(pool, 3) == 0


def test_a_cost_above_every_budget_is_never_admitted(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 5, tokens=Rate(100, 60.0)))
    assert busy(pool, 101).never  # no wait would help
    assert spent(pool) == 0
    pool.sync([KeySpec(1, 5, tokens=Rate(100, 60.0)), KeySpec(2, 1, status="disabled")])
    assert not busy(pool, 101).never  # key 2 has no budget: it could serve once enabled
    pool.sync([])
    assert not busy(pool, 101).never  # no keys at all: idle, not "never"


def test_a_key_without_a_budget_ignores_costs(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 5))
    for _ in range(5):
        lease_ok(pool, 10**9)
    state = pool.snapshot()[0]
    assert state.tokens is None and state.tokens_used == 0


def test_removed_key_loses_its_token_window(redis_client: redis.Redis) -> None:
    spec = KeySpec(1, 5, tokens=Rate(1000, 60.0))
    pool = make_pool(redis_client, spec)
    lease_ok(pool, 900)
    pool.sync([])
    pool.sync([spec])
    lease_ok(pool, 900)


def test_bad_costs_are_refused(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 5, tokens=Rate(1000, 60.0)))
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="cost"):
            pool.lease("w", 1.0, cost=bad)  # type: ignore[arg-type]
    lease = lease_ok(pool, 10)
    with pytest.raises(ValueError, match="used tokens"):
        pool.release(lease, used=-5)


def test_a_full_token_window_is_no_capacity(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 5, tokens=Rate(1000, 60.0)), KeySpec(2, 3))
    assert pool.capacity() == 8
    lease_ok(pool, 1000)  # key 1 (least loaded, tie broken by the cursor) or key 2
    pool.lease_many("w", 30.0, 7, cost=1000)
    states = {s.key_id: s for s in pool.snapshot()}
    assert states[1].tokens_full and not states[1].serving and states[1].available == 0
    assert pool.capacity() == 0


def test_charges_of_calls_without_a_cost_leave_the_window_too(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 5, tokens=Rate(100, 0.3)))
    pool.release(lease_ok(pool, 0), used=100)
    time.sleep(0.35)
    pool.release(lease_ok(pool, 0), used=10)  # never a lease with a cost: purged at release
    assert redis_client.zcard(keys.pool_key_tokens("llm", 1)) == 1
    assert spent(pool) == 10
