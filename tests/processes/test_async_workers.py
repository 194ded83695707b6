"""Concurrent execution with real Celery workers: async handlers on each process's event loop,
and sync handlers on ``-P threads``. Thousands of jobs each recorded once, time limits and
cancellation that really stop a job, SIGKILL with hundreds in flight losing nothing, and a warm
shutdown that finishes or hands back what it holds."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine, text

from harvest import keystore
from harvest.app import Harvest
from harvest.settings import Settings
from tests.helpers import statuses
from tests.processes.api_server import ApiServer, max_overlap
from tests.processes.conftest import Cluster, wait_until

pytestmark = pytest.mark.slow


def effects_per_job(engine: Engine, ids: list[int]) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT job_id, count(*) FROM test_effects WHERE job_id = ANY(:ids) GROUP BY 1"),
            {"ids": ids},
        ).all()
    return {int(r[0]): int(r[1]) for r in rows}


def running(engine: Engine, ids: list[int]) -> int:
    return statuses(engine, ids).get("running", 0)


def with_keys(
    settings: Settings, redis_client: redis.Redis, *, keys: int, concurrency: int
) -> Settings:
    """``settings`` with a secret key, and ``keys`` keys of ``concurrency`` in test-pool."""
    settings = settings.model_copy(update={"secret_key": SecretStr(Fernet.generate_key().decode())})
    cipher = keystore.Cipher.from_settings(settings)
    admin = Harvest(settings)
    with admin.sessions.begin() as session:
        for i in range(keys):
            keystore.add_key(
                session, cipher, pool="test-pool", name=f"k{i}", secret=f"sk-test-{i:04d}-x",
                max_concurrency=concurrency,
            )  # fmt: skip
    keystore.sync_pool(admin.engine, redis_client, "test-pool")
    admin.close()
    return settings


@contextmanager
def keyed_run(
    settings: Settings, tmp_path: Path
) -> Iterator[tuple[Cluster, Harvest, ApiServer, str]]:
    """A cluster with the keys' secret, an enqueuing app, and the logging API server and its
    URL; all three stopped at the end."""
    server = ApiServer()
    url = server.start()
    cluster = Cluster(settings, tmp_path)
    cluster.env["HARVEST_SECRET_KEY"] = settings.secret_key.get_secret_value()  # type: ignore[union-attr]
    client = Harvest(settings)
    client.load_imports(["tests.jobs"])
    try:
        yield cluster, client, server, url
    finally:
        cluster.stop()
        client.close()
        server.stop()


def all_succeed(effects: Engine, ids: list[int], timeout: float) -> None:
    wait_until(
        lambda: statuses(effects, ids).get("succeeded") == len(ids),
        timeout=timeout,
        interval=0.5,
        what=f"all {len(ids)} jobs to succeed ({statuses(effects, ids)})",
    )


def test_two_thousand_async_jobs_each_recorded_once(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    cluster.up()  # a schedule worker, an execution worker of 2 processes, beat
    cluster.wait_ready()
    rng = random.Random(12)
    ids = client_app.enqueue_many(
        "async_effect", [{"seconds": rng.uniform(0.2, 2.0)} for _ in range(2000)]
    )
    # 2 processes x 100 async jobs at once (the default): about 11 s of waiting in all.
    wait_until(
        lambda: statuses(effects, ids).get("succeeded") == 2000,
        timeout=180,
        interval=1.0,
        what=f"2,000 async jobs to succeed ({statuses(effects, ids)})",
    )
    counts = effects_per_job(effects, ids)
    assert len(counts) == 2000 and set(counts.values()) == {1}


def test_async_time_limit_and_cancel_with_real_workers(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    cluster.up()
    cluster.wait_ready()
    timed = client_app.enqueue("async_timed_out", {})
    doomed = client_app.enqueue("async_cancellable", {"seconds": 120})
    wait_until(
        lambda: client_app.get(timed.id).attempts >= 1 and client_app.get(timed.id).finished_at,
        timeout=60,
        what="the timed-out job to end its first attempt",
    )
    # FAST in conftest: lease 3 s, so heartbeats every second.
    wait_until(lambda: running(effects, [doomed.id]), timeout=60, what="the cancellable job to run")
    time.sleep(0.5)
    asked = time.monotonic()
    client_app.cancel(doomed.id)
    job = client_app.wait(doomed.id, timeout=30)
    assert job.status == "cancelled"
    assert time.monotonic() - asked < 5  # within a heartbeat (1 s) and a write
    final = client_app.wait(timed.id, timeout=60)
    assert final.status == "failed" and final.attempts == 2  # retried once, then dead
    assert final.last_error is not None and final.last_error.startswith("JobTimeout")


def test_thread_pool_time_limit_and_cancel_with_real_workers(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    """Sync jobs on -P threads: a job past its time limit is ended as timed out at its deadline
    (the thread runs on; its late result is dropped), and a cancel reaches a running job."""
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=8, pool="threads")
    cluster.beat()
    cluster.wait_ready()
    timed = client_app.enqueue("timed_out", {})  # timeout 0.5 s, sleeps 10 s, 2 attempts
    doomed = client_app.enqueue("cooperative", {"seconds": 120})
    wait_until(lambda: running(effects, [doomed.id]), timeout=60, what="the cooperative job")
    time.sleep(0.5)
    asked = time.monotonic()
    client_app.cancel(doomed.id)
    assert client_app.wait(doomed.id, timeout=30).status == "cancelled"
    assert time.monotonic() - asked < 5
    final = client_app.wait(timed.id, timeout=60)
    assert final.status == "failed" and final.attempts == 2
    assert final.last_error is not None and final.last_error.startswith("JobTimeout")
    assert final.started_at is not None and final.finished_at is not None
    assert (final.finished_at - final.started_at).total_seconds() < 1.5  # at its deadline
    assert "Python cannot stop it" in cluster.logs(tail=50000)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_sigkill_with_hundreds_in_flight_loses_nothing(
    pool: str, cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    """Async jobs on prefork (2 x 150 on their loops), or sync jobs on -P threads -c 220: kill
    the execution worker with everything in flight; a second worker finishes every job."""
    name, concurrency, env = (
        ("async_effect", 2, {"HARVEST_ASYNC_CONCURRENCY": "150"})
        if pool == "prefork"
        else ("effect", 220, {})
    )
    count = 300 if pool == "prefork" else 220
    cluster.worker("schedule", concurrency=1)
    victim = cluster.worker("execution", concurrency=concurrency, pool=pool, **env)
    cluster.beat()
    cluster.wait_ready()
    ids = client_app.enqueue_many(name, [{"seconds": 4.0}] * count)
    least = 200
    wait_until(
        lambda: running(effects, ids) >= least,
        timeout=60,
        what=f"{least} jobs running at once ({statuses(effects, ids)})",
    )
    cluster.kill(victim)  # SIGKILL to the whole process group
    victim.wait(10)
    cluster.worker("execution", concurrency=concurrency, pool=pool, **env)
    wait_until(
        lambda: statuses(effects, ids).get("succeeded") == count,
        timeout=240,
        interval=1.0,
        what=f"every job to succeed after the kill ({statuses(effects, ids)})",
    )
    counts = effects_per_job(effects, ids)
    assert len(counts) == count  # none lost; those killed mid-call ran again (at least once)


def test_warm_shutdown_finishes_what_it_can_and_hands_back_the_rest(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    cluster.worker("schedule", concurrency=1)
    worker = cluster.worker("execution", concurrency=1, HARVEST_SHUTDOWN_GRACE="2")
    cluster.beat()
    cluster.wait_ready()
    quick = client_app.enqueue_many("async_effect", [{"seconds": 1.0}] * 20)
    slow = client_app.enqueue_many("async_cancellable", [{"seconds": 120}] * 5)
    wait_until(lambda: running(effects, quick + slow) >= 25, timeout=60, what="25 running")
    cluster.signal(worker, signal.SIGTERM)
    assert worker.wait(60) == 0
    logs = cluster.logs(tail=20000)
    assert "warm shutdown: 25 async jobs were in flight; 20 finished, 5 handed back" in logs
    assert statuses(effects, quick) == {"succeeded": 20}
    with effects.connect() as conn:
        rows = conn.execute(
            text("SELECT status, attempts, last_error FROM harvest_jobs WHERE id = ANY(:ids)"),
            {"ids": slow},
        ).all()
    # Back at once (and dispatched again: the schedule worker still runs), no attempt used.
    assert {r[0] for r in rows} <= {"pending", "dispatched"} and {r[1] for r in rows} == {0}
    assert all(r[2].startswith("handed back") for r in rows)


def test_sigkill_of_async_jobs_holding_keys_loses_nothing_and_never_overlaps_a_key(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis, effects: Engine, tmp_path: Path
) -> None:
    """250 async jobs through 10 keys of concurrency 25: kill the worker with 200+ calls in
    flight. Every job succeeds; the service never sees a key over its concurrency (a dead
    worker's leases expire before another worker may take the key)."""
    settings = with_keys(migrated, redis_client, keys=10, concurrency=25)
    with keyed_run(settings, tmp_path) as (cluster, client, server, url):
        cluster.worker("schedule", concurrency=1)
        victim = cluster.worker("execution", concurrency=2, HARVEST_ASYNC_CONCURRENCY="150")
        cluster.beat()
        cluster.wait_ready()
        # Calls of 1.5 s, under the 3 s lease: a killed worker's calls end before its key
        # leases expire (a lease must outlive the longest call it covers).
        ids = client.enqueue_many("async_call_api", [{"url": url, "hold": 1.5}] * 250)
        wait_until(lambda: running(effects, ids) >= 200, timeout=60, what="200 keyed jobs running")
        cluster.kill(victim)
        victim.wait(10)
        cluster.worker("execution", concurrency=2, HARVEST_ASYNC_CONCURRENCY="150")
        all_succeed(effects, ids, timeout=180)
    by_key: dict[str, list[Any]] = {}
    for call in server.calls:
        by_key.setdefault(call.key, []).append(call)
    assert len(by_key) == 10
    assert max(max_overlap(calls) for calls in by_key.values()) <= 25
    assert set(effects_per_job(effects, ids)) == set(ids)


def test_sync_keyed_jobs_on_threads_fill_a_key_to_its_concurrency(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis, effects: Engine, tmp_path: Path
) -> None:
    """-P threads -c 16, one key of concurrency 10, jobs calling with ``ctx.client()``: the
    service sees 10 calls at once on the key, never 11 (each job borrows the key's pooled
    client while it holds a lease; a pool of 4 clients a key held it to 4)."""
    settings = with_keys(migrated, redis_client, keys=1, concurrency=10)
    with keyed_run(settings, tmp_path) as (cluster, client, server, url):
        cluster.worker("schedule", concurrency=1)
        cluster.worker("execution", concurrency=16, pool="threads")
        cluster.beat()
        cluster.wait_ready()
        ids = client.enqueue_many("call_api", [{"url": url, "hold": 1.0}] * 40)
        all_succeed(effects, ids, timeout=120)
    assert max_overlap(server.calls) == 10
    assert set(effects_per_job(effects, ids)) == set(ids)


def test_sync_jobs_on_gevent_run_many_at_once_with_real_time_limits(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    """-P gevent -c 100: 300 sync jobs of 1 s run about 100 at a time; a job past its time
    limit is stopped (gevent.Timeout) and retried; a cancel reaches a running job."""
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=100, pool="gevent", HARVEST_IMPORTS="tests.jobs_sync")
    cluster.beat()
    cluster.wait_ready()
    started = time.monotonic()
    ids = client_app.enqueue_many("effect", [{"seconds": 1.0}] * 300)
    timed = client_app.enqueue("timed_out", {})
    doomed = client_app.enqueue("cooperative", {"seconds": 120})
    wait_until(
        lambda: statuses(effects, ids).get("succeeded") == 300,
        timeout=120,
        interval=0.5,
        what=f"300 jobs on gevent ({statuses(effects, ids)})",
    )
    assert time.monotonic() - started < 60  # one at a time would take 300 s
    assert set(effects_per_job(effects, ids).values()) == {1}
    wait_until(lambda: running(effects, [doomed.id]), timeout=60, what="the cooperative job")
    client_app.cancel(doomed.id)
    assert client_app.wait(doomed.id, timeout=30).status == "cancelled"
    final = client_app.wait(timed.id, timeout=60)
    assert final.status == "failed" and final.attempts == 2
    assert final.last_error is not None and final.last_error.startswith("JobTimeout")
    assert final.started_at is not None and final.finished_at is not None
    assert (final.finished_at - final.started_at).total_seconds() < 1.5
    log = cluster.worker_logs("execution")
    # Every message acked (100 greenlets ack at once: kombu's 10 connections a channel were
    # too few), and no attempt's outcome dropped for a lease another delivery took.
    assert "Couldn't ack" not in log and "Traceback" not in log
    assert "lease lost" not in log


def test_gevent_worker_refuses_async_jobs_with_one_line(cluster: Cluster) -> None:
    """tests.jobs has async def jobs: a gevent worker cannot run them safely and says so."""
    proc = cluster.worker("execution", concurrency=10, pool="gevent")
    assert proc.wait(30) == 78  # EX_CONFIG
    log = cluster.logs(tail=5000)
    assert "harvest worker: harvest runs async def jobs on its own event loop" in log
    assert "Traceback" not in log
