"""The fair semaphore with expiring permits against real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from harvest.coordination.semaphore import Semaphore, SemaphoreBusy


def test_limit_is_never_exceeded(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 3)
    tokens = [sem.acquire(f"h{i}", 30.0) for i in range(3)]
    assert all(tokens) and len(set(tokens)) == 3
    assert sem.acquire("h4", 30.0) is None
    assert sem.held() == 3


def test_release_only_by_holder(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 1)
    token = sem.acquire("h", 30.0)
    assert token is not None
    assert sem.release("not-a-token") is False
    assert sem.acquire("other", 30.0) is None, "a wrong token freed nothing"
    assert sem.release(token) is True
    assert sem.release(token) is False, "released twice"
    assert sem.acquire("other", 30.0) is not None


def test_permits_expire_and_stale_tokens_lose_them(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 1)
    old = sem.acquire("dead", 0.2)
    assert old is not None and sem.acquire("x", 1.0) is None
    time.sleep(0.25)
    new = sem.acquire("alive", 30.0)
    assert new is not None
    assert sem.refresh(old, 30.0) is False
    assert sem.release(old) is False
    assert sem.held() == 1 and sem.acquire("x", 1.0) is None


def test_refresh_keeps_a_permit(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 1)
    token = sem.acquire("h", 0.3)
    assert token is not None
    for _ in range(5):
        time.sleep(0.1)
        assert sem.refresh(token, 0.3)
    assert sem.acquire("x", 1.0) is None


def _wait_in_line(sem: Semaphore, name: str, order: list[str], timeout: float) -> None:
    token = sem.acquire(name, 5.0, timeout=timeout)
    if token is not None:
        order.append(name)
        time.sleep(0.05)
        sem.release(token)


def test_waiters_are_served_first_come_first_served(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 1)
    first = sem.acquire("first", 30.0)
    assert first is not None
    order: list[str] = []
    threads = []
    for name in ("w1", "w2", "w3"):
        thread = threading.Thread(target=_wait_in_line, args=(sem, name, order, 5.0))
        thread.start()
        threads.append(thread)
        time.sleep(0.1)  # w1 queues before w2 before w3
    sem.release(first)
    assert sem.acquire("newcomer", 5.0) is None, "a newcomer may not overtake the line"
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["w1", "w2", "w3"]


def test_a_waiter_that_gives_up_leaves_the_line(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 1)
    holder = sem.acquire("h", 30.0)
    assert holder is not None
    started = time.monotonic()
    assert sem.acquire("impatient", 5.0, timeout=0.2) is None
    assert 0.15 < time.monotonic() - started < 1.0
    sem.release(holder)
    assert sem.acquire("next", 5.0) is not None


def test_context_manager_forms(redis_client: redis.Redis) -> None:
    sem = Semaphore(redis_client, "crawl", 1)
    with pytest.raises(RuntimeError), sem.permit("h", 5.0) as token:
        assert token is not None and sem.held() == 1
        raise RuntimeError("boom")
    assert sem.held() == 0, "released although the block raised"
    blocker = sem.acquire("b", 5.0)
    with sem.permit("h", 5.0, raise_on_failure=False) as token:
        assert token is None
    with pytest.raises(SemaphoreBusy), sem.permit("h", 5.0, timeout=0.05):
        pass
    assert blocker is not None and sem.release(blocker)


def test_bad_arguments(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="limit"):
        Semaphore(redis_client, "x", 0)
    with pytest.raises(ValueError, match="ttl"):
        Semaphore(redis_client, "x", 1).acquire("h", 0)
