"""Cancellation with the Runner in-process: a pending job ends cancelled at once and its
handler never runs; a running job sees ``ctx.cancelled`` and ends cancelled; harvest checks the
cancel request before any retry, whether or not the handler looked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import redis
from sqlalchemy import Engine

from harvest import store
from harvest.app import Harvest
from harvest.jobs import Job
from harvest.models import JobStatus
from harvest.runner import Runner
from tests.helpers import body, claim_all, effect_count


@pytest.fixture
def app(jobs_app: Callable[..., Harvest], redis_client: redis.Redis) -> Harvest:
    # A short lease: the heartbeat (a third of it) notices a cancel request within 0.2 s.
    return jobs_app({"lease_ttl": 0.6}, redis_client=redis_client)


def get(app: Harvest, job_id: int) -> Job:
    return app.get(job_id)


def test_cancelled_pending_job_never_runs(app: Harvest, runner: Runner, effects: Engine) -> None:
    ref = app.enqueue("cooperative", {"seconds": 0.1})
    kept = app.enqueue("cooperative", {"seconds": 0.1})
    assert app.cancel(ref.id) is JobStatus.CANCELLED
    claimed = claim_all(effects)
    assert [c.id for c in claimed] == [kept.id]
    runner.execute(body(claimed))
    assert effect_count(effects, ref.id) == 0
    assert effect_count(effects, kept.id) == 1
    job = get(app, ref.id)
    assert job.status is JobStatus.CANCELLED and job.finished_at is not None
    assert job.started_at is None and job.attempts == 0


def test_job_cancelled_while_its_message_is_in_flight_never_runs(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("cooperative", {"seconds": 0.1})
    claimed = claim_all(effects)  # dispatched: its message is on its way to a worker
    assert app.cancel(ref.id) is JobStatus.DISPATCHED
    counts = runner.execute(body(claimed))
    assert counts["started"] == 0
    assert effect_count(effects, ref.id) == 0
    job = get(app, ref.id)
    assert (job.status, job.attempts) == (JobStatus.CANCELLED, 0)


def test_running_job_sees_ctx_cancelled_and_ends_cancelled(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("cooperative", {"seconds": 30})
    worker = threading.Thread(target=runner.execute, args=(body(claim_all(effects)),))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while effect_count(effects, ref.id) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert get(app, ref.id).status is JobStatus.RUNNING
        asked = time.monotonic()
        assert app.cancel(ref.id) is JobStatus.RUNNING
        job = app.wait(ref.id, timeout=10)
        stopped_after = time.monotonic() - asked
    finally:
        worker.join(40)
    assert job.status is JobStatus.CANCELLED
    assert job.result == {"stopped": "cancelled"}  # the handler saw it and returned
    assert stopped_after < 3
    assert job.attempts == 1 and effect_count(effects, ref.id) == 1


def test_a_failure_after_a_cancel_request_ends_cancelled_not_retried(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    """The handler never looks at ctx.cancelled and then fails with a retryable error:
    harvest checks the cancel request before retrying."""
    ref = app.enqueue("fails_slowly", {"seconds": 1.0})
    worker = threading.Thread(target=runner.execute, args=(body(claim_all(effects)),))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while effect_count(effects, ref.id) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        app.cancel(ref.id)
        job = app.wait(ref.id, timeout=10)
    finally:
        worker.join(30)
    assert job.status is JobStatus.CANCELLED
    assert job.attempts == 1 and effect_count(effects, ref.id) == 1
    assert job.last_error == "RuntimeError: failed after the cancel request"


def test_store_turns_a_retry_of_a_cancel_requested_job_into_cancelled(
    app: Harvest, effects: Engine
) -> None:
    """Even when no heartbeat told the worker (the request came after its last beat)."""
    ref = app.enqueue("noop", {})
    [claimed] = claim_all(effects)
    with effects.begin() as conn:
        assert store.start(conn, claimed.id, claimed.token, ttl=300)
    app.cancel(ref.id)
    with effects.begin() as conn:
        assert store.finish(
            conn, ref.id, claimed.token, status=JobStatus.PENDING, error="boom", retry_delay=5
        )
    job = get(app, ref.id)
    assert job.status is JobStatus.CANCELLED and job.finished_at is not None
    assert claim_all(effects) == []


def test_a_deferred_job_with_a_cancel_request_ends_cancelled(app: Harvest, effects: Engine) -> None:
    ref = app.enqueue("noop", {})
    [claimed] = claim_all(effects)
    app.cancel(ref.id)
    with effects.begin() as conn:
        assert store.defer(conn, ref.id, claimed.token, delay=1.0)
    assert get(app, ref.id).status is JobStatus.CANCELLED


def test_cancelling_a_finished_job_changes_nothing(app: Harvest, runner: Runner) -> None:
    ref = app.enqueue("noop", {})
    runner.execute(body(claim_all(app.engine)))
    assert app.cancel(ref.id) is JobStatus.SUCCEEDED
    assert get(app, ref.id).status is JobStatus.SUCCEEDED
