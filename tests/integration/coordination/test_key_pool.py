"""The key pool against real Redis: limits, fairness, expiry, stale holders, sync, loss."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from harvest.coordination import keys
from harvest.coordination.key_pool import IDLE_RETRY, AsyncKeyPool, Busy, KeyPool, KeySpec, Lease
from harvest.coordination.rate_limit import Rate, parse_rate
from harvest.errors import NoKeyAvailable, PoolNotLoaded

OWNER_KEY = "harvest:test:owner"


def make_pool(client: redis.Redis, *specs: KeySpec, name: str = "ai") -> KeyPool:
    pool = KeyPool(client, name)
    pool.sync(list(specs))
    return pool


def lease_ok(pool: KeyPool, holder: str = "w", ttl: float = 30.0) -> Lease:
    result = pool.lease(holder, ttl)
    assert isinstance(result, Lease), f"expected a lease, got {result}"
    return result


def busy(pool: KeyPool, holder: str = "w", ttl: float = 30.0) -> Busy:
    result = pool.lease(holder, ttl)
    assert isinstance(result, Busy), f"expected Busy, got {result}"
    return result


def flushdb(client: redis.Redis) -> None:
    """Simulate Redis losing everything (keeps this run's claim on its db number)."""
    owner = client.get(OWNER_KEY)
    client.flushdb()
    if owner is not None:
        client.set(OWNER_KEY, owner, ex=4 * 3600)


# --- loading ------------------------------------------------------------------------------


def test_unsynced_pool_is_reported_not_loaded(redis_client: redis.Redis) -> None:
    pool = KeyPool(redis_client, "ai")
    assert not pool.is_loaded()
    with pytest.raises(PoolNotLoaded, match="'ai'"):
        pool.lease("w", 1.0)
    with pytest.raises(PoolNotLoaded):
        pool.capacity()


def test_flushdb_is_detected_and_old_leases_are_lost(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    lease = lease_ok(pool)
    assert pool.is_loaded()
    flushdb(redis_client)
    assert not pool.is_loaded()
    with pytest.raises(PoolNotLoaded):
        pool.lease("w", 1.0)
    assert pool.heartbeat(lease, 5.0) is False
    assert pool.release(lease) is False
    pool.sync([KeySpec(1, 1)])
    again = lease_ok(pool)
    assert again.fence > lease.fence, "fences must keep increasing after Redis lost its data"


def test_epoch_increases_on_every_sync(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    first = pool.epoch()
    pool.sync([KeySpec(1, 2)])
    assert first is not None and pool.epoch() == first + 1


def test_key_names_used_by_scripts_come_from_keys_module(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(7, 1, parse_rate("5/s")))
    lease_ok(pool)
    for name in (
        keys.pool_epoch("ai"),
        keys.pool_members("ai"),
        keys.pool_cursor("ai"),
        keys.pool_fence("ai"),
        keys.pool_key_config("ai", 7),
        keys.pool_key_leases("ai", 7),
        keys.pool_key_rate("ai", 7),
    ):
        assert redis_client.exists(name), name
    assert all(k.startswith(b"harvest:") for k in redis_client.keys("*"))


def test_bad_specs_and_names_are_refused(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        KeySpec(1, 0)
    with pytest.raises(ValueError, match="status"):
        KeySpec(1, 1, status="paused")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cooldown_until"):
        KeySpec(1, 1, status="cooling")
    with pytest.raises(ValueError, match="listed twice"):
        KeyPool(redis_client, "ai").sync([KeySpec(1, 1), KeySpec(1, 2)])
    with pytest.raises(ValueError, match="pool name"):
        KeyPool(redis_client, "a {b}")
    assert not KeyPool(redis_client, "ai").is_loaded(), "a refused sync must store nothing"


# --- concurrency, fairness ----------------------------------------------------------------


def test_never_more_leases_than_max_concurrency(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1), KeySpec(2, 2))
    leases = [lease_ok(pool) for _ in range(3)]
    retry = busy(pool, ttl=30.0).retry_after
    assert 29.0 < retry <= 30.0, "retry_after is the earliest lease expiry"
    assert Counter(lease.key_id for lease in leases) == {1: 1, 2: 2}
    assert pool.capacity() == 0
    assert pool.release(leases[0])
    assert lease_ok(pool).key_id == leases[0].key_id


def test_least_loaded_key_first(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, *(KeySpec(i, 3) for i in range(1, 5)))
    first_four = [lease_ok(pool).key_id for _ in range(4)]
    assert sorted(first_four) == [1, 2, 3, 4], "each key gets one lease before any gets two"
    second_four = [lease_ok(pool).key_id for _ in range(4)]
    assert sorted(second_four) == [1, 2, 3, 4]


def test_round_robin_uses_every_key_evenly(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, *(KeySpec(i, 2) for i in range(1, 6)))
    used = []
    for _ in range(50):
        lease = lease_ok(pool)
        used.append(lease.key_id)
        assert pool.release(lease)
    counts = Counter(used)
    assert set(counts) == {1, 2, 3, 4, 5}
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_fences_increase(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 5))
    fences = [lease_ok(pool).fence for _ in range(5)]
    assert fences == sorted(fences) and len(set(fences)) == 5


def test_lease_many_spreads_and_stops_at_limits(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 2), KeySpec(2, 2), KeySpec(3, 2))
    batch = pool.lease_many("w", 30.0, 5)
    assert isinstance(batch, list)
    assert sorted(Counter(lease.key_id for lease in batch).values()) == [1, 2, 2]
    rest = pool.lease_many("w", 30.0, 10)
    assert isinstance(rest, list) and len(rest) == 1
    assert isinstance(pool.lease_many("w", 30.0, 3), Busy)
    with pytest.raises(ValueError, match="lease count"):
        pool.lease_many("w", 30.0, 0)


# --- expiry, heartbeats, stale holders ----------------------------------------------------


def test_expired_lease_is_reclaimed_without_a_sweeper(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    dead = lease_ok(pool, "dead", ttl=0.2)
    assert busy(pool).retry_after <= 0.2
    time.sleep(0.25)
    fresh = lease_ok(pool, "fresh")
    assert fresh.key_id == 1 and fresh.fence > dead.fence


def test_expired_leases_and_old_grants_are_not_counted_and_go_when_the_key_is_granted(
    redis_client: redis.Redis,
) -> None:
    """A lease script counts a key's live leases and its window's grants by score, and
    removes what expired only from the key it grants: the retry a full key reports is its
    earliest *live* lease's expiry, and a key's sets never grow past its limits."""
    pool = make_pool(redis_client, KeySpec(1, 3, Rate(3, 0.5)))
    lease_ok(pool, "dead", ttl=0.2)
    held = [lease_ok(pool, "live", ttl=5.0), lease_ok(pool, "live", ttl=4.0)]
    time.sleep(0.55)  # the dead lease expired, and all three grants left the rate window
    pool.sync([KeySpec(1, 2, Rate(3, 0.5))])  # full again: 2 live leases of 2
    assert 3.0 < busy(pool).retry_after <= 4.0  # the 4 s lease, not the expired one
    leases, rate = keys.pool_key_leases("ai", 1), keys.pool_key_rate("ai", 1)
    assert redis_client.zcard(leases) == 3 and redis_client.zcard(rate) == 3  # not removed yet
    pool.release(held.pop())
    lease_ok(pool, "next")
    assert redis_client.zcard(leases) == 2 and redis_client.zcard(rate) == 1


def test_stale_holder_cannot_release_or_heartbeat(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    stale = lease_ok(pool, "stale", ttl=0.15)
    time.sleep(0.2)
    current = lease_ok(pool, "current")
    assert pool.heartbeat(stale, 10.0) is False
    assert pool.release(stale) is False
    busy(pool)  # the stale calls did not free the current holder's lease
    assert pool.heartbeat(current, 10.0) is True
    assert pool.release(current) is True
    assert pool.release(current) is False, "a second release reports the lease gone"


def test_release_then_lease_frees_the_key_first_in_one_round_trip(
    redis_client: redis.Redis,
) -> None:
    """One key of concurrency 1: the next holder gets the very key the last one gives back
    (the release runs first), with a fence of its own; a stale holder's release frees nothing
    and the lease then finds the key busy; after Redis lost its scripts, both still run."""
    pool = make_pool(redis_client, KeySpec(1, 1))
    first = lease_ok(pool, "first")
    freed, second = pool.release_then_lease(first, "second", 30.0)
    assert freed is True and isinstance(second, Lease)
    assert second.key_id == 1 and second.fence > first.fence
    freed, third = pool.release_then_lease(first, "third", 30.0)  # first's lease is gone
    assert freed is False and isinstance(third, Busy)
    redis_client.script_flush()
    freed, fourth = pool.release_then_lease(second, "fourth", 30.0)
    assert freed is True and isinstance(fourth, Lease) and fourth.fence > second.fence
    assert pool.release(fourth) is True


def test_a_hand_off_takes_the_key_it_frees_when_that_key_admits_the_call(
    redis_client: redis.Redis,
) -> None:
    """Two keys of concurrency 2, one full and one half: a hand-off of a lease of the full key
    takes that key again every time (its load stays as it was; a scan would find the two keys
    tied and go round robin). A key that no longer admits the call (cooling after a 429) is not
    taken: the pool is scanned."""
    pool = make_pool(redis_client, KeySpec(1, 2), KeySpec(2, 2))
    held = [lease_ok(pool, str(i)) for i in range(3)]  # one key full, the other half
    full = Counter(x.key_id for x in held).most_common(1)[0][0]
    lease = next(x for x in held if x.key_id == full)
    for _ in range(6):
        freed, lease = pool.release_then_lease(lease, "next", 30.0)  # type: ignore[assignment]
        assert freed is True and isinstance(lease, Lease) and lease.key_id == full
    pool.throttle(lease, 30.0)  # a 429: the key cools; the slot is taken on the other key
    freed, other = pool.release_then_lease(lease, "after 429", 30.0)
    assert freed is True and isinstance(other, Lease) and other.key_id != full


def test_one_script_leases_for_several_holders_in_order_and_says_busy_for_the_rest(
    redis_client: redis.Redis,
) -> None:
    """AsyncKeyPool.lease_each: three holders, two slots (two keys of concurrency 1): the first
    two get a lease each, one per key, with their own tokens; the third gets the pool's Busy."""
    make_pool(redis_client, KeySpec(1, 1), KeySpec(2, 1))
    where = redis_client.get_connection_kwargs()

    async def scenario() -> list[Lease | Busy]:
        client = AsyncRedis(host=where["host"], port=where["port"], db=where["db"])
        try:
            return await AsyncKeyPool(client, "ai").lease_each(["a", "b", "c"], 30.0)
        finally:
            await client.aclose()

    first, second, third = asyncio.run(scenario())
    assert isinstance(first, Lease) and first.token.endswith(":a")
    assert isinstance(second, Lease) and second.token.endswith(":b")
    assert {first.key_id, second.key_id} == {1, 2} and first.fence != second.fence
    assert isinstance(third, Busy) and third.retry_after > 0


def test_the_asyncio_pool_hands_a_key_over_and_renews_after_redis_lost_its_scripts(
    redis_client: redis.Redis,
) -> None:
    """AsyncKeyPool: release-then-lease as the blocking pool does, and a heartbeat round
    (bare EVALSHAs in one pipeline) that still renews every lease after ``SCRIPT FLUSH``
    (NOSCRIPT: each script runs again alone, which loads it), and reports a lost one."""
    make_pool(redis_client, KeySpec(1, 2))
    where = redis_client.get_connection_kwargs()

    async def scenario() -> tuple[bool, Lease | Busy, list[bool], list[bool]]:
        client = AsyncRedis(host=where["host"], port=where["port"], db=where["db"])
        try:
            pool = AsyncKeyPool(client, "ai")
            first = await pool.lease("first", 30.0)
            other = await pool.lease("other", 30.0)
            assert isinstance(first, Lease) and isinstance(other, Lease)
            freed, second = await pool.release_then_lease(first, "second", 30.0)
            assert isinstance(second, Lease)
            redis_client.script_flush()
            beats = await pool.heartbeat_many([second, other, first], 30.0)
            again = await pool.heartbeat_many([second, other], 30.0)
            return freed, second, beats, again
        finally:
            await client.aclose()

    freed, second, beats, again = asyncio.run(scenario())
    assert freed is True and isinstance(second, Lease) and second.key_id == 1
    assert beats == [True, True, False] and again == [True, True]


def test_a_key_given_back_while_jobs_wait_wakes_one_waiting_process_at_once(
    redis_client: redis.Redis,
) -> None:
    """A process whose lease try found no key waits for one (BLPOP) instead of sleeping its
    poll: a release by another process wakes it at once, and one release wakes one waiter."""
    holder_side = make_pool(redis_client, KeySpec(1, 1))
    where = redis_client.get_connection_kwargs()
    other = redis.Redis(host=where["host"], port=where["port"], db=where["db"])  # its own client
    waiter_side = KeyPool(other, "ai")
    held = lease_ok(holder_side, "holder")
    busy(waiter_side, "waiter")  # the pool is now wanted
    woken: list[tuple[bool, float]] = []

    def wait() -> None:
        began = time.monotonic()
        woken.append((waiter_side.await_freed(5.0), time.monotonic() - began))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    assert holder_side.release(held)
    thread.join(6.0)
    assert woken and woken[0][0] is True and 0.2 < woken[0][1] < 2.0, woken
    assert isinstance(waiter_side.lease("waiter", 30.0), Lease)
    assert waiter_side.await_freed(0.2) is False  # one key freed, one process woken
    other.close()


def test_a_release_wakes_nobody_unless_a_try_failed_and_a_hand_off_never_does(
    redis_client: redis.Redis,
) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    assert pool.release(lease_ok(pool))  # nobody wanted a key
    assert pool.await_freed(0.2) is False
    first = lease_ok(pool, "first")
    busy(pool, "second")  # wanted now
    freed, second = pool.release_then_lease(first, "second", 30.0)
    assert freed and isinstance(second, Lease)  # the slot freed was taken in the same trip
    assert pool.await_freed(0.2) is False
    assert redis_client.pttl(keys.pool_wanted("ai")) > 0


def test_the_asyncio_gate_waits_for_a_freed_key_or_its_poll(redis_client: redis.Redis) -> None:
    """AsyncKeyPool.await_freed: woken by a release of another process, else back after the
    time asked."""
    holder_side = make_pool(redis_client, KeySpec(1, 1))
    where = redis_client.get_connection_kwargs()

    async def scenario() -> tuple[bool, float, bool, float]:
        client = AsyncRedis(host=where["host"], port=where["port"], db=where["db"])
        try:
            pool = AsyncKeyPool(client, "ai")
            began = time.monotonic()
            idle = await pool.await_freed(0.3)
            idle_for = time.monotonic() - began
            held = lease_ok(holder_side, "holder")
            assert isinstance(await pool.lease("waiter", 30.0), Busy)
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, holder_side.release, held)
            began = time.monotonic()
            woken = await pool.await_freed(5.0)
            return idle, idle_for, woken, time.monotonic() - began
        finally:
            await client.aclose()

    idle, idle_for, woken, woken_after = asyncio.run(scenario())
    assert idle is False and 0.25 < idle_for < 2.0
    assert woken is True and woken_after < 2.0


def test_heartbeat_keeps_a_lease_alive(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    lease = lease_ok(pool, ttl=0.3)
    for _ in range(6):
        time.sleep(0.1)
        assert pool.heartbeat(lease, 0.3)
    busy(pool)
    until = pool.heartbeat_until(lease, 5.0)
    assert until is not None and until > lease.expires_at


def test_acquire_waits_for_a_key_then_raises(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    lease_ok(pool, ttl=0.2)
    started = time.monotonic()
    got = pool.acquire("waiter", 5.0, timeout=2.0)
    assert got.key_id == 1 and 0.1 < time.monotonic() - started < 1.0
    with pytest.raises(NoKeyAvailable) as info:
        pool.acquire("late", 5.0, timeout=0.1)
    assert info.value.pool == "ai" and 4.0 < info.value.retry_after <= 5.0


def test_leased_context_releases_and_has_a_non_raising_form(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    with pytest.raises(RuntimeError), pool.leased("w", 5.0):
        assert pool.capacity() == 0
        raise RuntimeError("handler failed")
    assert pool.capacity() == 1, "the lease was released although the block raised"
    held = lease_ok(pool)
    with pool.leased("w", 5.0, raise_on_failure=False) as lease:
        assert lease is None
    with pytest.raises(NoKeyAvailable), pool.leased("w", 5.0):
        pass
    assert pool.release(held)


# --- rate limits --------------------------------------------------------------------------


def test_rate_limit_per_key_with_sliding_refill(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 10, Rate(3, 0.5)))
    for _ in range(3):
        assert pool.release(lease_ok(pool))
        time.sleep(0.12)
    retry = busy(pool).retry_after
    assert 0 < retry <= 0.5 - 0.24
    time.sleep(retry + 0.01)
    assert pool.release(lease_ok(pool))
    busy(pool)  # only the oldest permit slid out of the window, not all three


def test_busy_attempts_do_not_spend_rate_permits(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1, Rate(2, 5.0)))
    held = lease_ok(pool)
    for _ in range(5):
        busy(pool)  # refused for concurrency: must not count as a call
    assert pool.release(held)
    assert pool.release(lease_ok(pool))
    retry = busy(pool).retry_after
    assert 4.0 < retry <= 5.0, "now refused by the rate limit, until the window slides"


def test_capacity_counts_concurrency_and_rate(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 2), KeySpec(2, 3, Rate(1, 10.0)), KeySpec(3, 4))
    pool.disable(3)
    assert pool.capacity() == 3
    lease_ok(pool)
    assert pool.capacity() == 2


# --- cooldown, disable, enable ------------------------------------------------------------


def test_cooldown_ends_by_itself(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    until = pool.cooldown(1, 0.3)
    assert until is not None and until > time.time()
    assert pool.snapshot()[0].status == "cooling"
    assert 0.1 < busy(pool).retry_after <= 0.3
    time.sleep(0.35)
    assert pool.snapshot()[0].status == "active"
    lease_ok(pool)


def test_cooldown_is_never_shortened(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1))
    pool.cooldown(1, 5.0)
    pool.cooldown(1, 0.05)
    pool.sync([KeySpec(1, 1)])  # a sync from a source that did not see the 429
    time.sleep(0.1)
    assert busy(pool).retry_after > 4.0
    assert pool.cooldown(99, 1.0) is None, "unknown key"


def test_spec_cooldown_from_postgres_is_honoured(redis_client: redis.Redis) -> None:
    spec = KeySpec(1, 1, status="cooling", cooldown_until=time.time() + 0.2)
    pool = make_pool(redis_client, spec)
    busy(pool)
    time.sleep(0.25)
    lease_ok(pool)


def test_disable_and_enable(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1), KeySpec(2, 1))
    held = lease_ok(pool)
    other = 3 - held.key_id
    assert pool.disable(other)
    assert busy(pool).retry_after > 20.0, "only the held key can free up: at its expiry"
    assert pool.heartbeat(held, 5.0), "disabling stops new leases, not live ones"
    assert pool.disable(held.key_id)
    assert busy(pool).retry_after == IDLE_RETRY, "nothing frees up by time alone"
    assert {s.key_id: s.status for s in pool.snapshot()} == {1: "disabled", 2: "disabled"}
    assert pool.release(held)
    busy(pool)
    assert pool.enable(other)
    assert lease_ok(pool).key_id == other
    assert not pool.enable(42)


# --- sync ---------------------------------------------------------------------------------


def test_sync_keeps_live_leases_and_drops_removed_keys(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 1), KeySpec(2, 1))
    one = lease_ok(pool)
    two = lease_ok(pool)
    kept, dropped = (one, two) if one.key_id == 1 else (two, one)
    pool.sync([KeySpec(1, 1), KeySpec(3, 1)])
    assert pool.heartbeat(kept, 5.0), "a live lease of a kept key survives a sync"
    assert not pool.heartbeat(dropped, 5.0), "a removed key's lease is gone"
    assert lease_ok(pool).key_id == 3, "key 1 is still held, so the new key 3 is leased"
    busy(pool)
    assert [s.key_id for s in pool.snapshot()] == [1, 3]


def test_lowering_max_concurrency_keeps_leases_but_blocks_new(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 3))
    held = [lease_ok(pool) for _ in range(3)]
    pool.sync([KeySpec(1, 1)])
    busy(pool)
    pool.release(held[0])
    pool.release(held[1])
    busy(pool)
    pool.release(held[2])
    lease_ok(pool)


def test_snapshot_reports_live_state(redis_client: redis.Redis) -> None:
    pool = make_pool(redis_client, KeySpec(1, 2, Rate(10, 60.0)), KeySpec(2, 1))
    pool.disable(2)
    lease_ok(pool)
    one, two = pool.snapshot()
    assert (one.key_id, one.status, one.live_leases, one.max_concurrency) == (1, "active", 1, 2)
    assert one.rate == Rate(10, 60.0) and one.rate_used == 1 and one.cooldown_until is None
    assert (two.status, two.live_leases, two.rate) == ("disabled", 0, None)
