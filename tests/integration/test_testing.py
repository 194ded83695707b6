"""harvest.testing: a project's jobs run in-process against the real Postgres, with the same
validation, retries and outcomes as a worker; the app is put back after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine

from harvest import Harvest, JobContext, PermanentError, RetryPolicy
from harvest.errors import InvalidPayload
from harvest.models import JobStatus
from harvest.settings import Settings
from harvest.testing import HarvestTesting, run_pending

project = Harvest(Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/not_used"))
calls: list[tuple[str, int]] = []


@project.job("greet")
def greet(ctx: JobContext, name: str) -> dict[str, str]:
    calls.append(("greet", ctx.attempt))
    return {"hello": name}


@project.job("flaky", max_attempts=3, retry=RetryPolicy(base=60.0))
def flaky(ctx: JobContext, succeed_on: int = 99) -> int:
    calls.append(("flaky", ctx.attempt))
    if ctx.attempt < succeed_on:
        raise RuntimeError(f"attempt {ctx.attempt} failed")
    return ctx.attempt


@project.job("hopeless", max_attempts=5)
def hopeless(ctx: JobContext) -> None:
    raise PermanentError("never")


@pytest.fixture
def testing(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> Iterator[HarvestTesting]:
    calls.clear()
    harvest = HarvestTesting(migrated.database_url)
    yield harvest
    harvest.restore()


def test_use_points_the_app_at_the_test_database_and_restores_it(
    testing: HarvestTesting, migrated: Settings
) -> None:
    before = project.settings
    app = testing.use(project)
    assert app is project and app.settings.database_url == migrated.database_url
    app.nudge()  # off: nothing reaches Redis or the broker
    testing.restore()
    assert project.settings is before
    assert project.nudge.__func__ is Harvest.nudge  # type: ignore[attr-defined]


def test_a_job_runs_to_success_as_on_a_worker(testing: HarvestTesting) -> None:
    app = testing.use(project)
    ref = greet.enqueue(name="Ada")
    [job] = testing.run_pending()
    assert (job.id, job.status, job.result, job.attempts) == (
        ref.id,
        JobStatus.SUCCEEDED,
        {"hello": "Ada"},
        1,
    )
    assert app.get(ref.id).worker is not None
    assert testing.run_pending() == []  # nothing is due any more


def test_retries_run_at_once_until_the_last_attempt(testing: HarvestTesting) -> None:
    testing.use(project)
    dead = flaky.enqueue()
    healed = flaky.enqueue(succeed_on=2)
    jobs = {job.id: job for job in testing.run_pending()}
    assert (jobs[dead.id].status, jobs[dead.id].attempts) == (JobStatus.FAILED, 3)
    assert jobs[dead.id].last_error == "RuntimeError: attempt 3 failed"
    assert (jobs[healed.id].status, jobs[healed.id].result) == (JobStatus.SUCCEEDED, 2)


def test_without_retries_a_failed_attempt_waits_for_its_backoff(
    testing: HarvestTesting,
) -> None:
    testing.use(project)
    ref = flaky.enqueue()
    [job] = testing.run_pending(retries=False)
    assert (job.id, job.status, job.attempts) == (ref.id, JobStatus.PENDING, 1)


def test_delayed_jobs_run_only_when_asked(testing: HarvestTesting) -> None:
    testing.use(project)
    ref = greet.options(delay=3600).enqueue(name="later")
    assert testing.run_pending() == []
    [job] = testing.run_pending(delayed=True)
    assert (job.id, job.status) == (ref.id, JobStatus.SUCCEEDED)


def test_the_door_and_the_failure_classes_are_the_workers(testing: HarvestTesting) -> None:
    app = testing.use(project)
    with pytest.raises(InvalidPayload):
        app.enqueue("greet", {"nom": "Ada"})
    ref = app.enqueue("hopeless", {})
    [job] = testing.run_pending()
    assert (job.id, job.status, job.attempts) == (ref.id, JobStatus.FAILED, 1)


def test_run_pending_on_an_app_without_the_fixture(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    app = Harvest(migrated)
    app.jobs.update(project.jobs)
    try:
        ref = app.enqueue("greet", {"name": "Grace"})
        assert [job.result for job in run_pending(app)] == [{"hello": "Grace"}]
        assert app.get(ref.id).status is JobStatus.SUCCEEDED
    finally:
        app.close()
