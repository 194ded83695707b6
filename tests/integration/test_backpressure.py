"""Backpressure: a queue (and a job name) holds at most its max depth of pending jobs; enqueue
beyond it raises QueueFull and stores nothing, or waits for room when asked; enqueue_many takes
what fits and says how many."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.errors import InvalidOption, JobDepthFull, QueueFull
from harvest.models import JobStatus
from harvest.settings import Settings


def make_app(settings: Settings, redis_client: redis.Redis, **limits: Any) -> Harvest:
    app = Harvest(settings.model_copy(update=limits), redis_client=redis_client)
    app.load_imports(["tests.jobs"])
    return app


@pytest.fixture
def small(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    """A Harvest whose queues hold at most 10 pending jobs."""
    app = make_app(migrated, redis_client, max_queue_depth=10)
    yield app
    app.close()


def pending(engine: Engine, name: str | None = None) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM harvest_jobs WHERE status = 'pending' "
                    "AND (CAST(:n AS text) IS NULL OR name = :n)"
                ),
                {"n": name},
            ).scalar_one()
        )


def rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one())


def test_enqueue_beyond_max_depth_raises_queue_full_and_stores_nothing(
    small: Harvest, clean_db: Engine
) -> None:
    for i in range(10):
        small.enqueue("echo", {"value": i})
    with pytest.raises(QueueFull) as info:
        small.enqueue("echo", {"value": "one too many"})
    assert (info.value.queue, info.value.depth, info.value.limit) == ("execution", 10, 10)
    assert "queue 'execution' is full: 10 pending, limit 10" in str(info.value)
    assert rows(clean_db) == 10
    # Room comes back as jobs leave pending (here: cancelled).
    first = small.enqueue_many("echo", [], priority=0)
    assert first == []
    with clean_db.connect() as conn:
        some = conn.execute(text("SELECT min(id) FROM harvest_jobs")).scalar_one()
    small.cancel(some)
    assert small.enqueue("echo", {"value": "fits again"}).created
    assert pending(clean_db) == 10


def test_delayed_jobs_count_as_pending(small: Harvest, clean_db: Engine) -> None:
    small.enqueue_many("echo", [{"value": i} for i in range(10)], delay=3600)
    with pytest.raises(QueueFull):
        small.enqueue("echo", {})
    assert rows(clean_db) == 10


def test_enqueue_many_takes_what_fits_and_says_how_many(small: Harvest, clean_db: Engine) -> None:
    for i in range(4):
        small.enqueue("echo", {"value": i})
    ids = small.enqueue_many("echo", [{"value": 100 + i} for i in range(10)])
    assert len(ids) == 6
    with clean_db.connect() as conn:
        stored = conn.execute(
            text("SELECT payload FROM harvest_jobs WHERE id = ANY(:ids) ORDER BY id"), {"ids": ids}
        ).scalars()
        assert [p["value"] for p in stored] == list(range(100, 106))  # the first ones
    with pytest.raises(QueueFull):
        small.enqueue_many("echo", [{"value": 1}] * 3)
    assert rows(clean_db) == 10


def test_a_job_max_depth_bounds_its_own_pending_jobs(small: Harvest, clean_db: Engine) -> None:
    assert small.spec("limited").max_depth == 5
    taken = small.enqueue_many("limited", [{"value": i} for i in range(8)])
    assert len(taken) == 5
    with pytest.raises(JobDepthFull) as info:
        small.enqueue("limited", {"value": "six"})
    assert isinstance(info.value, QueueFull)
    assert "job 'limited' is full: 5 pending, its max_depth is 5" in str(info.value)
    small.enqueue("echo", {"value": "other jobs still fit"})
    assert pending(clean_db, "limited") == 5 and rows(clean_db) == 6


def test_per_queue_override(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    app = make_app(migrated, redis_client, queue_max_depths={"execution": 3})
    try:
        assert len(app.enqueue_many("echo", [{}] * 5)) == 3
        with pytest.raises(QueueFull, match="limit 3"):
            app.enqueue("echo", {})
    finally:
        app.close()
    parsed = Settings(queue_max_depths="execution=3, bulk=50")  # type: ignore[arg-type]
    assert parsed.queue_max_depths == {"execution": 3, "bulk": 50}
    assert parsed.queue_depth_limit("bulk") == 50
    assert parsed.queue_depth_limit("other") == 1_000_000
    with pytest.raises(ValidationError, match="queue=n"):
        Settings(queue_max_depths="execution")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="at least 1"):
        Settings(queue_max_depths="execution=0")  # type: ignore[arg-type]


def test_wait_for_room(small: Harvest, clean_db: Engine) -> None:
    ids = small.enqueue_many("echo", [{"value": i} for i in range(10)])
    started = time.monotonic()
    with pytest.raises(QueueFull):
        small.enqueue("echo", {}, wait=0.4)
    assert 0.4 <= time.monotonic() - started < 2

    def free_one() -> None:
        time.sleep(0.5)
        small.cancel(ids[0])

    helper = threading.Thread(target=free_one)
    helper.start()
    started = time.monotonic()
    ref = small.enqueue("echo", {"value": "waited"}, wait=10)
    waited = time.monotonic() - started
    helper.join()
    assert ref.created and 0.4 <= waited < 5
    assert pending(clean_db) == 10
    with pytest.raises(InvalidOption, match="invalid wait"):
        small.enqueue("echo", {}, wait=-1)
    with pytest.raises(InvalidOption, match="invalid wait"):
        small.enqueue_many("echo", [{}], wait=float("nan"))


def test_idempotent_enqueue_on_a_full_queue_returns_the_existing_job(
    small: Harvest, clean_db: Engine
) -> None:
    first = small.enqueue("echo", {}, idempotency_key="k")
    small.enqueue_many("echo", [{}] * 9)
    again = small.enqueue("echo", {}, idempotency_key="k")
    assert again.id == first.id and not again.created
    with pytest.raises(QueueFull):
        small.enqueue("echo", {}, idempotency_key="new key")
    assert rows(clean_db) == 10


def test_a_batch_that_does_not_fit_stores_nothing(small: Harvest, clean_db: Engine) -> None:
    small.enqueue_many("echo", [{}] * 5)
    with pytest.raises(QueueFull):
        small.enqueue_batch([("echo", {})] * 6, on_complete="batch_done")
    assert rows(clean_db) == 5
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_batches")).scalar_one() == 0
    assert len(small.enqueue_batch([("echo", {})] * 5).job_ids) == 5


def test_threads_of_one_process_never_overshoot(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    """16 threads sharing one Harvest (one per-process depth cache) race to a limit of 300:
    the fast path trusts recent counts below 90 %, the rest is counted under the lock."""
    app = make_app(migrated, redis_client, max_queue_depth=300)
    barrier = threading.Barrier(16)
    refused = [0] * 16

    def enqueue(i: int) -> None:
        barrier.wait(30)
        for _ in range(40):
            try:
                app.enqueue("echo", {})
            except QueueFull:
                refused[i] += 1

    try:
        threads = [threading.Thread(target=enqueue, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        app.close()
    assert rows(clean_db) == 300
    assert sum(refused) == 16 * 40 - 300


def test_processes_near_the_limit_never_overshoot(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    """Separate Harvest objects (separate depth caches, as separate processes have) racing
    within the last 10 % of the limit all count under the exclusive lock: exact."""
    seed = make_app(migrated, redis_client, max_queue_depth=1000)
    seed.enqueue_many("echo", [{}] * 950)
    seed.close()
    apps = [make_app(migrated, redis_client, max_queue_depth=1000) for _ in range(12)]
    barrier = threading.Barrier(len(apps))
    taken = [0] * len(apps)

    def enqueue(i: int) -> None:
        barrier.wait(30)
        for _ in range(10):
            try:
                apps[i].enqueue("echo", {})
                taken[i] += 1
            except QueueFull:
                pass
            with contextlib.suppress(QueueFull):
                taken[i] += len(apps[i].enqueue_many("echo", [{}] * 3))

    try:
        threads = [threading.Thread(target=enqueue, args=(i,)) for i in range(len(apps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for a in apps:
            a.close()
    assert sum(taken) == 50
    assert rows(clean_db) == 1000


def test_retries_and_finished_jobs_do_not_count(small: Harvest, clean_db: Engine) -> None:
    ids = small.enqueue_many("echo", [{}] * 10)
    for job_id in ids[:4]:
        assert small.cancel(job_id) is JobStatus.CANCELLED
    assert len(small.enqueue_many("echo", [{}] * 10)) == 4


def test_far_from_the_limit_enqueue_does_not_count_every_time(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harvest import store

    counts: list[str] = []
    real = store.pending_depth

    def counting(conn: Any, key: str) -> int:
        counts.append(key)
        return real(conn, key)

    monkeypatch.setattr(store, "pending_depth", counting)
    app = make_app(migrated, redis_client)  # the default limit, 1,000,000
    try:
        started = time.monotonic()
        for _ in range(200):
            app.enqueue("echo", {})
        elapsed = time.monotonic() - started
        # One exact count per second at most (the first enqueue, then when the count is stale).
        assert 1 <= len(counts) <= 2 + elapsed
        counts.clear()
        for _ in range(4):  # its own max_depth of 5: trusted up to 90 % (4.5)
            app.enqueue("limited", {})
        assert counts.count("job:limited") == 1
        app.enqueue("limited", {})  # past 90 %: counted
        assert counts.count("job:limited") == 2
        with pytest.raises(JobDepthFull):
            app.enqueue("limited", {})
        assert counts.count("job:limited") == 3
    finally:
        app.close()


def test_an_enqueue_far_from_the_limit_waits_for_an_exact_count_in_flight(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    """The trusted enqueue (one statement: its shared depth lock, then its row) still waits
    for a count under the exclusive lock in another process, so that count never misses a
    row being made: the exactness near the limit rests on it."""
    from harvest import store

    app = make_app(migrated, redis_client)  # the default limit, 1,000,000: far from it
    try:
        app.enqueue("echo", {})  # counted once; the next ones trust that count
        done = threading.Event()
        with clean_db.connect() as counter:
            counter.execute(
                text("SELECT pg_advisory_xact_lock(:cls, hashtext(:key))"),
                {"cls": store.enqueue._LOCK_CLASS, "key": f"queue:{app.spec('echo').queue}"},
            )
            worker = threading.Thread(target=lambda: (app.enqueue("echo", {}), done.set()))
            worker.start()
            assert not done.wait(0.5), "the enqueue went past an exclusive depth lock"
            assert rows(clean_db) == 1
            counter.rollback()  # the count ends
        assert done.wait(10)
        worker.join()
        assert rows(clean_db) == 2
    finally:
        app.close()
