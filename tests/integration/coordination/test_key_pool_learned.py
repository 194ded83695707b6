"""Limits learned from the service, against real Redis: a 429 with room lowers a key's effective
limits (multiplicative decrease), calls that succeed grow them back (additive increase, never
above the declared ones), the service's rate-limit headers gate leases until their reset, and
concurrent 429s lower a key once."""

from __future__ import annotations

import threading
import time

import redis

from harvest.coordination.key_pool import LEARNING, Busy, KeyPool, KeySpec, KeyState, Lease
from harvest.coordination.rate_limit import Rate
from harvest.service_limits import Announced


def make_pool(client: redis.Redis, *specs: KeySpec) -> KeyPool:
    pool = KeyPool(client, "learn")
    pool.sync(list(specs))
    return pool


def lease_ok(pool: KeyPool, cost: int = 0) -> Lease:
    result = pool.lease("w", 30.0, cost=cost)
    assert isinstance(result, Lease), f"expected a lease, got {result}"
    return result


def state(pool: KeyPool, key_id: int = 1) -> KeyState:
    return next(s for s in pool.snapshot() if s.key_id == key_id)


def leases_now(pool: KeyPool) -> int:
    """How many leases the pool grants now (all held; the caller releases nothing)."""
    n = 0
    while isinstance(pool.lease("w", 30.0), Lease):
        n += 1
    return n


def test_a_429_with_room_halves_the_effective_limits(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 8, rate=Rate(100, 60.0)))
    lease = lease_ok(pool)
    done = pool.throttle(lease, 0.001)  # 1 lease of 8, 1 call of 100: there was room
    assert done is not None and done.lowered
    assert (done.max_concurrency, done.rate) == (4, 50)
    s = state(pool)
    assert (s.effective_max, s.effective_rate, s.lowered, s.learned) == (4, 50, 1, True)
    assert (s.max_concurrency, s.rate and s.rate.count) == (8, 100), "declared limits kept"
    assert s.learned_text == "C 4/8, R 50/100"  # harvest keys ls, the dashboard
    pool.release(lease)
    time.sleep(0.01)  # the cooldown passes
    assert leases_now(pool) == 4, "the lease script admits by the effective concurrency"


def test_no_decrease_when_the_declared_limits_were_exhausted(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 8, rate=Rate(2, 60.0)))
    first, second = lease_ok(pool), lease_ok(pool)  # the rate window is full (2 of 2)
    done = pool.throttle(second, 0.001)
    assert done is not None and not done.lowered, "a full window explains the 429"
    assert state(pool).effective_max == 8 and state(pool).lowered == 0
    pool.release(first)
    pool.release(second)

    roomy = make_pool(redis_client, KeySpec(2, 8, rate=Rate(100, 60.0)))
    lease = lease_ok(roomy)
    done = roomy.throttle(lease, 0.001, exhausted=True)  # its headers said 0 left
    assert done is not None and not done.lowered
    roomy.release(lease, announced=Announced(requests=0, requests_reset=30.0))
    lease = None
    time.sleep(0.01)
    assert isinstance(roomy.lease("w", 30.0), Busy), "nothing left until the announced reset"
    again = make_pool(redis_client, KeySpec(2, 8, rate=Rate(100, 60.0)))
    assert state(again, 2).announced_requests == 0
    assert state(again, 2).learned_text == "0 req left" and state(again, 2).available == 0


def test_one_decrease_per_round_of_calls(redis_client: redis.Redis) -> None:
    """Calls granted before a decrease were sent under the old limit: their 429s cool the key
    but do not lower it again."""
    pool = make_pool(redis_client, KeySpec(1, 8))
    held = [lease_ok(pool) for _ in range(4)]
    lowered = [pool.throttle(lease, 0.001) for lease in held]
    assert [t.lowered for t in lowered if t] == [True, False, False, False]
    assert state(pool).effective_max == 4
    for lease in held:
        pool.release(lease)
    time.sleep(0.01)
    later = lease_ok(pool)  # granted after the decrease: its 429 is news
    assert (t := pool.throttle(later, 0.001)) is not None and t.lowered
    assert state(pool).effective_max == 2


def test_successes_grow_it_back_never_above_declared(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 10, rate=Rate(1000, 60.0)))
    lease = lease_ok(pool)
    pool.throttle(lease, 0.001)  # 10 -> 5, the safe level is 9
    pool.release(lease)
    assert state(pool).effective_max == 5
    time.sleep(0.01)
    for _ in range(4):  # fast back to the safe level: + recover x declared (1) per success
        pool.release(lease_ok(pool), succeeded=True)
    assert state(pool).effective_max == 9
    pool.release(lease_ok(pool), succeeded=False)  # a failure grows nothing
    assert state(pool).effective_max == 9
    per_level = round(1 / LEARNING.step / 10)  # then slowly: + step x declared per success
    for _ in range(per_level + 5):
        pool.release(lease_ok(pool), succeeded=True)
    s = state(pool)
    assert (s.effective_max, s.learned) == (10, False), "back at the declared limit, no higher"
    assert s.effective_rate == 1000
    for _ in range(50):
        pool.release(lease_ok(pool), succeeded=True)
    assert state(pool).effective_max == 10
    pool.sync([KeySpec(1, 6, rate=Rate(1000, 60.0))])
    assert state(pool).effective_max == 6, "a lower declared limit wins"


def test_headers_drive_the_live_state(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 10), KeySpec(2, 10))
    first = lease_ok(pool)
    pool.release(first, announced=Announced(requests=2, requests_reset=0.3))
    key = first.key_id
    assert state(pool, key).announced_requests == 2
    held = [pool.lease("w", 30.0) for _ in range(6)]
    on_key = [h for h in held if isinstance(h, Lease) and h.key_id == key]
    assert len(on_key) == 2, "the key admits what the service said was left, then waits"
    assert state(pool, key).announced_requests == 0 and state(pool, key).available == 0
    for h in held:
        if isinstance(h, Lease):
            pool.release(h)
    time.sleep(0.35)  # the announced reset passes: the key's own limits again
    assert state(pool, key).announced_requests is None
    assert state(pool, key).available == 10

    tokens = make_pool(redis_client, KeySpec(3, 10, tokens=Rate(10_000, 60.0)))
    lease = lease_ok(tokens, cost=100)
    tokens.release(lease, used=100, announced=Announced(tokens=250, tokens_reset=30.0))
    assert isinstance(tokens.lease("w", 30.0, cost=200), Lease)
    busy = tokens.lease("w", 30.0, cost=100)  # 50 left by the service's word
    assert isinstance(busy, Busy) and 29.0 < busy.retry_after <= 30.0


def test_concurrent_429s_lower_a_key_once(redis_client: redis.Redis) -> None:
    """Many workers reporting 429s at once for calls of the same round: one decrease (the
    check of room, the fence and the write are one script)."""
    pool = make_pool(redis_client, KeySpec(1, 64))
    held = [lease_ok(pool) for _ in range(32)]
    results: list[bool] = []
    lock = threading.Lock()

    def report(lease: Lease) -> None:
        done = KeyPool(redis_client, "learn").throttle(lease, 0.001)
        with lock:
            results.append(bool(done and done.lowered))

    threads = [threading.Thread(target=report, args=(lease,)) for lease in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False] * 31 + [True]
    assert state(pool).effective_max == 32 and state(pool).lowered == 1
