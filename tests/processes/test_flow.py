"""Flow control on real Celery workers: a delay longer than the broker's visibility timeout,
priorities under a deep backlog (and aging), a 500-job batch barrier across workers, and
cancellation of pending and running jobs."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.models import JobStatus
from harvest.settings import Settings
from tests.helpers import statuses
from tests.processes.conftest import Cluster, wait_until, with_keys

pytestmark = pytest.mark.slow


def one(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).one()


def test_a_delay_longer_than_the_visibility_timeout_runs_exactly_once(
    cluster: Cluster, client_app: Harvest, effects: Engine, redis_client: redis.Redis
) -> None:
    """Celery's ETA pain: a countdown longer than the Redis visibility timeout is redelivered
    again and again. Here the delay lives in Postgres: no message exists until the job is due."""
    cluster.env["HARVEST_BROKER_VISIBILITY_TIMEOUT"] = "3"
    cluster.up(execution=2)
    ref = client_app.enqueue("effect", {}, delay=timedelta(seconds=7))
    time.sleep(4)  # past the visibility timeout, before the job is due
    job = client_app.get(ref.id)
    assert job.status is JobStatus.PENDING and job.dispatched_at is None  # never published
    assert redis_client.llen("execution") == 0
    done = client_app.wait(ref.id, timeout=60)
    assert done.status is JobStatus.SUCCEEDED
    assert done.started_at is not None and done.started_at >= done.run_at
    time.sleep(4)  # another visibility timeout: nothing comes back
    executions = one(effects, "SELECT count(*) FROM test_effects WHERE job_id = :id", id=ref.id)
    assert executions[0] == 1
    assert client_app.get(ref.id).attempts == 1


def test_jobs_whose_messages_redis_lost_are_sent_again_at_once_and_run_once(
    cluster: Cluster, client_app: Harvest, effects: Engine, redis_client: redis.Redis
) -> None:
    """A Redis broker restarted without persistence (here: flushed) takes the messages of the
    dispatched jobs with it; the dispatcher finds harvest's mark gone and sends those jobs again
    at once, not after HARVEST_DISPATCH_TTL (120 s here, as by default). Each runs once: a
    message a worker had already fetched finds its token gone."""
    cluster.env["HARVEST_DISPATCH_TTL"] = "120"
    cluster.up(execution=1, concurrency=1)
    ids = client_app.enqueue_many("effect", [{"seconds": 0.1}] * 60)
    wait_until(lambda: redis_client.llen("execution") > 0, 60, 0.02, "messages in the broker")
    redis_client.flushdb()
    wait_until(
        lambda: statuses(effects, ids).get("succeeded") == len(ids), 60, 0.5, "every job, at once"
    )
    runs = one(
        effects,
        "SELECT count(*), count(DISTINCT job_id) FROM test_effects WHERE job_id = ANY(:ids)",
        ids=ids,
    )
    assert tuple(runs) == (60, 60)
    logs = cluster.worker_logs("schedule")
    assert "dispatched jobs were taken back to be sent again" in logs


def test_ten_thousand_low_and_a_hundred_high_priority_jobs(
    cluster: Cluster, client_app: Harvest, engine: Engine
) -> None:
    """All due together: every high-priority job starts before the low-priority ones that
    were not already in flight; then the low-priority ones flow. (That none waits forever under
    a continuing flood of higher priorities is the aging share: the next test.)"""
    low = client_app.enqueue_many("noop", [{}] * 10_000, priority=-5)
    high = client_app.enqueue_many("echo", [{"value": i} for i in range(100)], priority=50)
    cluster.up(execution=2)
    try:
        wait_until(lambda: statuses(engine, high).get("succeeded") == 100, 90, 0.5, "high done")
        last_high = one(
            engine,
            "SELECT max(started_at), max(dispatched_at) FROM harvest_jobs WHERE id = ANY(:i)",
            i=high,
        )
        ahead = one(
            engine,
            "SELECT count(*) FILTER (WHERE started_at < :s), "
            "count(*) FILTER (WHERE dispatched_at < :d) FROM harvest_jobs WHERE id = ANY(:i)",
            s=last_high[0], d=last_high[1], i=low,
        )  # fmt: skip
        # No low job was claimed before the last high one (the first claim mixes 100 high
        # and 100 low, all stamped at once); the few low jobs that started before the last high
        # one were in those same first messages.
        assert ahead[1] == 0
        assert ahead[0] <= client_app.settings.claim_batch_size
        wait_until(
            lambda: statuses(engine, low).get("succeeded", 0) >= 1000, 60, 1.0, "low jobs flow"
        )
    except AssertionError:
        print(statuses(engine, low), cluster.logs())
        raise


def test_starving_low_priority_jobs_run_under_a_flood_of_high_priority_ones(
    cluster: Cluster, client_app: Harvest, engine: Engine
) -> None:
    """With HARVEST_STARVATION_AFTER=2 s, low-priority jobs start while higher-priority ones
    keep arriving faster than the workers can run them (600 jobs/s of 5 ms each: no-op jobs
    would not do, a prefork worker runs thousands a second since their writes are shared)."""
    cluster.env["HARVEST_STARVATION_AFTER"] = "2"
    cluster.up(execution=1)
    low = client_app.enqueue_many("noop", [{}] * 20, priority=-100)
    high: list[int] = []
    deadline = time.monotonic() + 25
    try:
        while time.monotonic() < deadline and statuses(engine, low).get("succeeded", 0) < 20:
            high += client_app.enqueue_many("sleepy", [{"seconds": 0.005}] * 300, priority=100)
            time.sleep(0.5)
        waiting_high = statuses(engine, high).get("pending", 0)
        assert statuses(engine, low).get("succeeded") == 20
        assert waiting_high > 0, "the flood never outran the workers: the test proves nothing"
        # Each low job went out while higher-priority jobs, enqueued before it went out, still
        # waited: only the aging share lets it overtake them.
        overtook = one(
            engine,
            "SELECT count(*) FROM harvest_jobs AS l WHERE l.id = ANY(:low) AND EXISTS ("
            " SELECT 1 FROM harvest_jobs AS h WHERE h.id = ANY(:high)"
            " AND h.created_at < l.dispatched_at"
            " AND (h.dispatched_at IS NULL OR h.dispatched_at > l.dispatched_at))",
            low=low, high=high,
        )  # fmt: skip
        assert overtook[0] == 20
        waited = one(
            engine,
            "SELECT max(extract(epoch FROM started_at - run_at)) FROM harvest_jobs "
            "WHERE id = ANY(:low)",
            low=low,
        )
        assert waited[0] < 2 + 15  # the threshold, then a few claim rounds
    except AssertionError:
        print(statuses(engine, low), statuses(engine, high), cluster.logs())
        raise


def test_a_batch_of_500_fires_its_callback_once_after_its_last_member(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    members = [
        ("permanent_failure", {}) if i % 10 == 3 else ("effect", {}) for i in range(500)
    ]  # 50 fail at once (PermanentError)
    ref = client_app.enqueue_batch(members, on_complete="batch_done")
    cluster.up(execution=2, concurrency=2)
    try:
        callback = wait_until(
            lambda: client_app.batch(ref.id).callback_job_id, 150, 0.5, "the batch to complete"
        )
        done = client_app.wait(callback, timeout=30)
    except AssertionError:
        print(client_app.batch(ref.id), cluster.logs())
        raise
    assert done.status is JobStatus.SUCCEEDED
    assert done.result == {
        "batch_id": ref.id, "succeeded": 450, "failed": 50, "cancelled": 0, "tag": "",
    }  # fmt: skip
    with effects.connect() as conn:
        callbacks = conn.execute(
            text("SELECT count(*) FROM harvest_jobs WHERE name = 'batch_done'")
        ).scalar_one()
        last_member = conn.execute(
            text("SELECT max(finished_at) FROM harvest_jobs WHERE batch_id = :b"), {"b": ref.id}
        ).scalar_one()
        workers = conn.execute(text("SELECT count(DISTINCT pid) FROM test_effects")).scalar_one()
    assert callbacks == 1
    assert done.started_at is not None and done.started_at >= last_member
    assert workers >= 2, "members all ended in one process: the test proves less than it says"
    batch = client_app.batch(ref.id)
    assert (batch.succeeded, batch.failed, batch.pending) == (450, 50, 0)


def test_cancel_pending_and_running_jobs(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    pending = client_app.enqueue("cooperative", {"seconds": 1}, delay=3)
    running = client_app.enqueue("cooperative", {"seconds": 60})
    assert client_app.cancel(pending.id) is JobStatus.CANCELLED
    cluster.up(execution=1)
    try:
        wait_until(
            lambda: client_app.get(running.id).status is JobStatus.RUNNING, 60, 0.1, "running"
        )
        asked = time.monotonic()
        assert client_app.cancel(running.id) is JobStatus.RUNNING
        stopped = client_app.wait(running.id, timeout=30)
        took = time.monotonic() - asked
        time.sleep(4)  # past the pending job's due time: still nothing runs it
    except AssertionError:
        print(cluster.logs())
        raise
    assert stopped.status is JobStatus.CANCELLED
    assert stopped.result == {"stopped": "cancelled"}
    assert took < 10  # a heartbeat (a third of the 3 s lease) tells the handler
    never = client_app.get(pending.id)
    assert never.status is JobStatus.CANCELLED and never.started_at is None
    with effects.connect() as conn:
        runs = dict(
            conn.execute(text("SELECT job_id, count(*) FROM test_effects GROUP BY job_id")).all()
        )
    assert runs == {running.id: 1}


def test_a_flood_of_short_sync_jobs_shares_its_writes_and_runs_each_job_once(
    cluster: Cluster, client_app: Harvest, effects: Engine, redis_client: redis.Redis
) -> None:
    """Prefork workers as the README starts them, 1,500 sync jobs of a fraction of a
    millisecond (after a first 100, from which the dispatcher learns their run time and
    sizes their messages): each runs once and succeeds on its first attempt, and most share
    the statement that started them with others (harvest/execution/run_ahead.py)."""
    cluster.env.update(LINGER)
    cluster.up(execution=1)
    cluster.wait_ready()
    _flood(client_app, effects, redis_client, "short_effect", 1500, most=0.5)


# The jobs' handler makes a Redis round trip (0.2-0.6 ms, more on a busy machine): a write
# linger of 10 ms (2 by default) lets several share a window however the machine runs.
LINGER = {"HARVEST_WRITE_LINGER_MS": "10"}


def _flood(
    client: Harvest, effects: Engine, redis_client: redis.Redis, name: str, n: int, most: float
) -> list[int]:
    """100 jobs of ``name`` (from which the dispatcher learns their run time and sizes their
    messages), then ``n``: each of those runs once and succeeds on its first attempt, and
    they take fewer than ``most`` start statements a job (1 without sharing). Their ids."""
    first = client.enqueue_many(name, [{}] * 100)
    wait_until(lambda: statuses(effects, first).get("succeeded", 0) == 100, 60, 0.2, "first")
    time.sleep(2.5)  # the dispatcher reads run times every 2 s
    ids = client.enqueue_many(name, [{}] * n)
    wait_until(lambda: statuses(effects, ids).get("succeeded", 0) == n, 120, 0.5, "all")
    ran = redis_client.hgetall("test:short_effects")
    assert sorted(int(ran[str(i).encode()]) for i in ids) == [1] * n  # each once
    shared = one(
        effects,
        "SELECT count(*) FILTER (WHERE attempts <> 1), count(DISTINCT (started_at, worker)) "
        "FROM harvest_jobs_all WHERE id = ANY(:ids)",
        ids=ids,
    )
    assert shared[0] == 0
    # one start statement a job before
    assert shared[1] < n * most, f"{shared[1]} start statements for {n} jobs"
    return ids


KEYS = 64


def test_a_flood_of_short_keyed_sync_jobs_shares_its_writes_and_never_doubles_a_key(
    routed: Settings,
    clean_db: Engine,
    effects: Engine,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    """As above, with a key each from a pool of 64 keys of one call at once (so many that the
    dispatcher sends messages of several jobs): the jobs of a window run one after another on
    the key lent along it. Each job runs once on its first
    attempt, no call ever found another on its key, most share their start statement, and
    every key is free at the end."""
    from harvest.coordination.key_pool import KeyPool

    keys = [("short-pool", f"k{n}", f"sk-short-{n}-0123456789", {"max_concurrency": 1})
            for n in range(KEYS)]  # fmt: skip
    settings = with_keys(routed, redis_client, keys)
    cluster = Cluster(settings, tmp_path)
    cluster.env["HARVEST_SECRET_KEY"] = settings.secret_key.get_secret_value()  # type: ignore[union-attr]
    cluster.env.update(LINGER)
    client = Harvest(settings)
    try:
        client.load_imports(["tests.jobs"])
        cluster.up(execution=1)
        cluster.wait_ready()
        # (its messages are smaller: a pool's jobs are sent as its keys can take them; here
        # 0.68 start statements a job, the first of a message's jobs starting alone)
        _flood(client, effects, redis_client, "short_keyed_effect", 1000, most=0.9)
        assert int(redis_client.get("test:short_overlaps") or 0) == 0
    finally:
        cluster.stop()
        client.close()
    states = KeyPool(redis_client, "short-pool").snapshot()
    assert [(s.status, s.live_leases) for s in states] == [("active", 0)] * KEYS
