"""The fenced lock and leader election against real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from harvest.coordination import keys
from harvest.coordination.lock import LeaderElector, Lock, LockNotAcquired


def test_exclusion(redis_client: redis.Redis) -> None:
    a = Lock(redis_client, "migrate", 10.0)
    b = Lock(redis_client, "migrate", 10.0)
    assert a.acquire(blocking=False)
    assert not b.acquire(blocking=False)
    assert Lock(redis_client, "other", 10.0).acquire(blocking=False)
    assert a.release()
    assert b.acquire(blocking=False)


def test_fencing_numbers_increase(redis_client: redis.Redis) -> None:
    fences = []
    for i in range(5):
        lock = Lock(redis_client, "migrate", 10.0)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        if i % 2:
            lock.release()
        else:
            redis_client.delete(keys.lock("migrate"))  # as if it expired
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(fences) and len(set(fences)) == 5


def test_reacquire_by_owner_renews_with_same_fence(redis_client: redis.Redis) -> None:
    lock = Lock(redis_client, "migrate", 10.0)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    assert lock.acquire(blocking=False) and lock.fence == fence


def test_expiry_lets_another_in_and_old_owner_cannot_release_or_extend(
    redis_client: redis.Redis,
) -> None:
    old = Lock(redis_client, "migrate", 0.2)
    new = Lock(redis_client, "migrate", 10.0)
    assert old.acquire(blocking=False)
    started = time.monotonic()
    assert new.acquire(timeout=2.0)
    assert 0.1 < time.monotonic() - started < 1.0
    assert new.fence is not None and old.fence is not None and new.fence > old.fence
    assert old.extend() is False
    assert old.release() is False
    assert not Lock(redis_client, "migrate", 1.0).acquire(blocking=False), "still held by new"
    assert new.extend(5.0) is True
    assert 4000 < redis_client.pttl(keys.lock("migrate")) <= 5000


def test_blocking_acquire_times_out(redis_client: redis.Redis) -> None:
    assert Lock(redis_client, "migrate", 10.0).acquire(blocking=False)
    waiter = Lock(redis_client, "migrate", 10.0)
    started = time.monotonic()
    assert waiter.acquire(timeout=0.3) is False
    assert 0.28 < time.monotonic() - started < 1.0
    assert waiter.token is None and waiter.fence is None


def test_context_manager_forms(redis_client: redis.Redis) -> None:
    lock = Lock(redis_client, "migrate", 10.0, blocking_timeout=0.1)
    with lock:
        assert redis_client.exists(keys.lock("migrate"))
        with pytest.raises(LockNotAcquired):
            Lock(redis_client, "migrate", 10.0, blocking_timeout=0.1).__enter__()
        with Lock(redis_client, "migrate", 1.0).held(timeout=0.05, raise_on_failure=False) as ok:
            assert ok is False
    assert not redis_client.exists(keys.lock("migrate")), "released on exit"
    with pytest.raises(RuntimeError), lock.held():
        raise RuntimeError("boom")
    assert not redis_client.exists(keys.lock("migrate")), "released although the block raised"


def test_auto_renew_keeps_the_lock(redis_client: redis.Redis) -> None:
    threads_before = {t.name for t in threading.enumerate()}
    lock = Lock(redis_client, "migrate", 0.3, auto_renew=True)
    assert not any(n.startswith("harvest-lock-renew") for n in threads_before)
    assert lock.acquire(blocking=False)
    assert any(t.name == "harvest-lock-renew:migrate" for t in threading.enumerate())
    time.sleep(1.0)
    assert not Lock(redis_client, "migrate", 1.0).acquire(blocking=False)
    assert not lock.lost.is_set()
    assert lock.release() is True
    assert not any(t.name == "harvest-lock-renew:migrate" for t in threading.enumerate())


def test_renewal_failure_sets_lost_without_raising(redis_client: redis.Redis) -> None:
    lock = Lock(redis_client, "migrate", 0.3, auto_renew=True)
    assert lock.acquire(blocking=False)
    redis_client.set(keys.lock("migrate"), "someone-else", px=10_000)  # taken over
    assert lock.lost.wait(1.0), "the owner is told its lock is gone"
    assert lock.release() is False
    assert redis_client.get(keys.lock("migrate")) == b"someone-else", "not released by old owner"


def test_leader_election(redis_client: redis.Redis) -> None:
    a = LeaderElector(redis_client, "beat", 0.3)
    b = LeaderElector(redis_client, "beat", 0.3)
    first = a.is_leader()
    assert first and first.fence is not None
    assert not b.is_leader() and b.is_leader().fence is None
    again = a.is_leader()
    assert again and again.fence == first.fence, "renewal keeps the term's fence"
    assert a.step_down() is True
    second = b.is_leader()
    assert second and second.fence is not None and second.fence > first.fence
    time.sleep(0.4)  # b stops renewing: its term ends with its TTL
    third = a.is_leader()
    assert third and third.fence is not None and third.fence > second.fence
    assert not b.is_leader()
    assert b.step_down() is False


def test_only_one_leader_at_a_time(redis_client: redis.Redis) -> None:
    terms: dict[int, set[int]] = {}
    guard = threading.Lock()
    stop = time.monotonic() + 1.5

    def campaign(me: int) -> None:
        elector = LeaderElector(
            redis.Redis(connection_pool=redis_client.connection_pool), "beat", 0.2
        )
        while time.monotonic() < stop:
            result = elector.is_leader()
            if result.leader:
                assert result.fence is not None
                with guard:
                    terms.setdefault(result.fence, set()).add(me)
                if me % 2:
                    elector.step_down()
            time.sleep(0.01)

    threads = [threading.Thread(target=campaign, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert terms, "someone led"
    assert all(len(who) == 1 for who in terms.values()), terms
