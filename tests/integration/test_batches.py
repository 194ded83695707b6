"""Batches: the callback job is enqueued exactly once, by the transaction that ends the last
member, with the right counts, whichever path ends each member, even when members end on
different connections at the same instant."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.db import make_engine
from harvest.errors import BatchNotFound, InvalidOption, InvalidPayload, UnknownJob
from harvest.jobs import Claimed
from harvest.models import JobStatus
from harvest.settings import Settings


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    harvest = Harvest(migrated, redis_client=redis_client)
    harvest.load_imports(["tests.jobs"])
    yield harvest
    harvest.close()


def claim_all(engine: Engine) -> dict[int, Claimed]:
    with engine.begin() as conn:
        return {c.id: c for c in store.claim_due(conn, limit=10_000, ttl=300)}


def start(engine: Engine, c: Claimed) -> Any:
    with engine.begin() as conn:
        return store.start(conn, c.id, c.token, ttl=300)


def finish(engine: Engine, c: Claimed, status: JobStatus) -> bool:
    with engine.begin() as conn:
        return store.finish(conn, c.id, c.token, status=status)


def callbacks(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id, payload, status FROM harvest_jobs WHERE name = 'batch_done'")
            )
        )


def count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def test_callback_fires_once_when_the_last_member_ends(app: Harvest, clean_db: Engine) -> None:
    ref = app.enqueue_batch(
        [("echo", {"value": i}) for i in range(4)] + [("permanent_failure", {})],
        on_complete="batch_done",
        on_complete_payload={"tag": "nightly"},
    )
    assert len(ref.job_ids) == 5
    progress = app.batch(ref.id)
    assert (progress.total, progress.pending, progress.complete) == (5, 5, False)
    claimed = claim_all(clean_db)
    assert set(claimed) == set(ref.job_ids)  # the callback does not exist yet
    for job_id in ref.job_ids[:4]:
        assert start(clean_db, claimed[job_id])
    assert start(clean_db, claimed[ref.job_ids[4]])
    for job_id in ref.job_ids[:3]:
        assert finish(clean_db, claimed[job_id], JobStatus.SUCCEEDED)
    assert finish(clean_db, claimed[ref.job_ids[4]], JobStatus.FAILED)
    assert callbacks(clean_db) == []
    assert app.batch(ref.id).pending == 1
    assert finish(clean_db, claimed[ref.job_ids[3]], JobStatus.SUCCEEDED)
    [callback] = callbacks(clean_db)
    assert callback.status == "pending"
    assert callback.payload == {
        "batch_id": ref.id,
        "succeeded": 4,
        "failed": 1,
        "cancelled": 0,
        "tag": "nightly",
    }
    done = app.batch(ref.id)
    assert (done.succeeded, done.failed, done.cancelled, done.pending) == (4, 1, 0, 0)
    assert done.complete and done.callback_job_id == callback.id
    assert done.on_complete == "batch_done"


def test_every_path_that_ends_a_job_is_counted(app: Harvest, clean_db: Engine) -> None:
    """finish, cancel of a pending member, a start that finds it cancelled, rescue."""
    ref = app.enqueue_batch([("echo", {"value": i}) for i in range(5)], on_complete="batch_done")
    ok, failed, pending, dispatched, lost = ref.job_ids
    assert app.cancel(pending) is JobStatus.CANCELLED  # pending -> cancelled at once
    claimed = claim_all(clean_db)
    assert app.cancel(dispatched) is JobStatus.DISPATCHED  # asked; the worker's start ends it
    assert start(clean_db, claimed[dispatched]) is JobStatus.CANCELLED
    for job_id in (ok, failed, lost):
        assert start(clean_db, claimed[job_id])
    assert finish(clean_db, claimed[ok], JobStatus.SUCCEEDED)
    assert finish(clean_db, claimed[failed], JobStatus.FAILED)
    with clean_db.begin() as conn:  # the worker running `lost` died on its last attempt
        conn.execute(
            text(
                "UPDATE harvest_jobs SET lease_expires_at = now() - interval '1 s', "
                "max_attempts = 1 WHERE id = :id"
            ),
            {"id": lost},
        )
    assert callbacks(clean_db) == []
    with clean_db.begin() as conn:
        assert store.rescue_expired(conn, limit=10).failed == [lost]
    [callback] = callbacks(clean_db)
    assert callback.payload == {"batch_id": ref.id, "succeeded": 1, "failed": 2, "cancelled": 2}


def test_members_ending_at_the_same_instant_on_different_connections(
    app: Harvest, migrated: Settings, clean_db: Engine
) -> None:
    """500 members (some failing, some cancelled) ended by 10 connections released together:
    the batch row's lock orders them; exactly one of them sees the batch complete."""
    members = [("echo", {"value": i}) for i in range(500)]
    ref = app.enqueue_batch(members, on_complete="batch_done")
    claimed = claim_all(clean_db)
    assert len(claimed) == 500
    for c in claimed.values():
        assert start(clean_db, c)
    with clean_db.begin() as conn:  # 20 are asked to cancel: their retry ends them cancelled
        conn.execute(
            text("UPDATE harvest_jobs SET cancel_requested = true WHERE id = ANY(:ids)"),
            {"ids": ref.job_ids[::25]},
        )
    outcome = {
        job_id: JobStatus.PENDING
        if i % 25 == 0
        else (JobStatus.FAILED if i % 7 == 0 else JobStatus.SUCCEEDED)
        for i, job_id in enumerate(ref.job_ids)
    }
    shares = [ref.job_ids[k::10] for k in range(10)]
    barrier = threading.Barrier(10)
    errors: list[BaseException] = []

    def end(share: list[int]) -> None:
        engine = make_engine(migrated, pool_size=1)
        try:
            barrier.wait(30)
            for job_id in share:
                c = claimed[job_id]
                with engine.begin() as conn:
                    assert store.finish(conn, c.id, c.token, status=outcome[job_id], error="e")
        except BaseException as exc:
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=end, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    cancelled = sum(1 for s in outcome.values() if s is JobStatus.PENDING)
    failed = sum(1 for s in outcome.values() if s is JobStatus.FAILED)
    [callback] = callbacks(clean_db)
    assert callback.payload == {
        "batch_id": ref.id,
        "succeeded": 500 - failed - cancelled,
        "failed": failed,
        "cancelled": cancelled,
    }
    assert cancelled == 20 and failed > 0
    with clean_db.connect() as conn:
        last_end = conn.execute(
            text("SELECT max(finished_at) FROM harvest_jobs WHERE batch_id = :b"), {"b": ref.id}
        ).scalar_one()
        created = conn.execute(
            text("SELECT created_at FROM harvest_jobs WHERE id = :id"), {"id": callback.id}
        ).scalar_one()
    assert created <= last_end or (created - last_end).total_seconds() < 5


def test_concurrent_cancels_of_pending_members(
    app: Harvest, migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    ref = app.enqueue_batch([("echo", {})] * 200, on_complete="batch_done")
    barrier = threading.Barrier(8)

    def cancel(share: list[int]) -> None:
        other = Harvest(migrated, redis_client=redis_client)
        try:
            barrier.wait(30)
            for job_id in share:
                other.cancel(job_id)
        finally:
            other.close()

    threads = [threading.Thread(target=cancel, args=(ref.job_ids[k::8],)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    [callback] = callbacks(clean_db)
    assert callback.payload["cancelled"] == 200


def test_a_member_retried_after_completion_moves_the_counts_not_the_callback(
    app: Harvest, clean_db: Engine
) -> None:
    ref = app.enqueue_batch([("echo", {}), ("echo", {})], on_complete="batch_done")
    claimed = claim_all(clean_db)
    for c in claimed.values():
        start(clean_db, c)
    finish(clean_db, claimed[ref.job_ids[0]], JobStatus.SUCCEEDED)
    finish(clean_db, claimed[ref.job_ids[1]], JobStatus.FAILED)
    assert len(callbacks(clean_db)) == 1
    app.retry(ref.job_ids[1])
    assert (app.batch(ref.id).failed, app.batch(ref.id).pending) == (0, 1)
    again = claim_all(clean_db)
    retried = again[ref.job_ids[1]]
    start(clean_db, retried)
    finish(clean_db, retried, JobStatus.SUCCEEDED)
    batch = app.batch(ref.id)
    assert (batch.succeeded, batch.failed, batch.pending) == (2, 0, 0)
    assert len(callbacks(clean_db)) == 1


def test_batch_without_callback_completes(app: Harvest, clean_db: Engine) -> None:
    ref = app.enqueue_batch([("echo", {})])
    assert app.cancel(ref.job_ids[0]) is JobStatus.CANCELLED
    batch = app.batch(ref.id)
    assert batch.complete and batch.callback_job_id is None and batch.cancelled == 1
    assert count(clean_db, "SELECT count(*) FROM harvest_jobs") == 1


BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("empty", {"jobs": []}, InvalidOption, "invalid jobs: a batch needs at least one job"),
    ("unknown member", {"jobs": [("echo", {}), ("nope", {})]}, UnknownJob, "item 1: unknown"),
    ("bad payload", {"jobs": [("echo", {"colour": 1})]}, InvalidPayload, "item 0: invalid"),
    ("not a pair", {"jobs": ["echo"]}, InvalidOption, "item 0: invalid jobs"),
    ("unknown callback", {"on_complete": "nope"}, InvalidOption, "invalid on_complete"),
    ("callback misfit", {"on_complete": "noop"}, InvalidOption, "cannot be the callback"),
    (
        "callback payload clash",
        {"on_complete": "batch_done", "on_complete_payload": {"failed": 3}},
        InvalidOption,
        "on_complete_payload: must not set failed",
    ),
    (
        "callback payload misfit",
        {"on_complete": "batch_done", "on_complete_payload": {"colour": 3}},
        InvalidOption,
        "colour",
    ),
    (
        "payload without callback",
        {"on_complete_payload": {"tag": "x"}},
        InvalidOption,
        "on_complete_payload",
    ),
    ("bad priority", {"priority": 10_000}, InvalidOption, "priority"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_batch_is_refused_and_stores_nothing(
    app: Harvest, clean_db: Engine, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    kwargs = dict(kwargs)
    jobs = kwargs.pop("jobs", [("echo", {"value": 1})])
    with pytest.raises(error) as info:
        app.enqueue_batch(jobs, **kwargs)
    assert fragment in str(info.value)
    assert count(clean_db, "SELECT count(*) FROM harvest_jobs") == 0
    assert count(clean_db, "SELECT count(*) FROM harvest_batches") == 0


def test_batch_size_is_bounded(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    app = Harvest(migrated.model_copy(update={"max_batch_size": 3}), redis_client=redis_client)
    app.load_imports(["tests.jobs"])
    try:
        with pytest.raises(InvalidOption, match="at most 3 jobs"):
            app.enqueue_batch([("echo", {})] * 4)
        assert len(app.enqueue_batch([("echo", {})] * 3).job_ids) == 3
    finally:
        app.close()


def test_unknown_batch(app: Harvest) -> None:
    with pytest.raises(BatchNotFound, match="no batch with id 424242"):
        app.batch(424242)


def test_the_trigger_ignores_jobs_outside_batches(clean_db: Engine) -> None:
    with clean_db.connect() as conn:
        definition = conn.execute(
            text(
                "SELECT pg_get_triggerdef(oid) FROM pg_trigger "
                "WHERE tgname = 'harvest_jobs_batch_member'"
            )
        ).scalar_one()
    assert "AFTER UPDATE OF status ON public.harvest_jobs FOR EACH ROW" in definition
    assert "WHEN (((new.batch_id IS NOT NULL)" in definition
