"""Async handlers and threaded sync handlers, run in-process by the Runner (no Celery) against
the real Postgres and Redis: many at once on one event loop, held to their time limits,
cancellable while they run, fenced like any job, and unknown names deferred without an attempt."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.execution import sql
from harvest.models import JobStatus
from harvest.runner import Runner
from tests.helpers import body, claim_all, effect_count


@pytest.fixture
def app(jobs_app: Callable[..., Harvest]) -> Harvest:
    # A short lease, so heartbeats (a third of it) come every half second.
    return jobs_app({"lease_ttl": 1.5, "unknown_job_grace": 60.0})


def job_row(engine: Engine, job_id: int) -> store.Job:
    with engine.connect() as conn:
        found = store.get(conn, job_id)
    assert found is not None
    return found


def test_async_jobs_of_one_message_run_at_once_each_once(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ids = app.enqueue_many("async_effect", [{"seconds": 0.5}] * 60)
    started = time.monotonic()
    counts = runner.execute(body(claim_all(effects)))
    took = time.monotonic() - started
    assert counts == {"started": 60, "suppressed": 0, "lost": 0, "deferred": 0}
    assert took < 10  # one after another would take 30 s
    assert all(effect_count(effects, i) == 1 for i in ids)
    assert {job_row(effects, i).status for i in ids} == {JobStatus.SUCCEEDED}


def test_a_message_larger_than_the_loops_room_is_handed_over_as_room_frees(
    jobs_app: Callable[..., Harvest], effects: Engine
) -> None:
    """HARVEST_ASYNC_CONCURRENCY=4 and a message of 10 async jobs (the dispatcher sends an
    async job's messages larger than a sync job's): never more than 4 run at once, the rest
    start as places free, and every job runs once."""
    app = jobs_app({"async_concurrency": 4})
    runner = Runner(app)
    try:
        ids = app.enqueue_many("async_effect", [{"seconds": 0.3}] * 10)
        message = [[c.id, str(c.token), c.name] for c in claim_all(effects)]
        peak = [0]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], runner.aio().admission.in_use)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        try:
            counts = runner.execute(message)
        finally:
            done.set()
            watcher.join()
        assert counts["started"] == 10
        assert peak[0] == 4
        assert time.monotonic() - started >= 0.85  # three rounds of 0.3 s, not one
        assert all(effect_count(effects, i) == 1 for i in ids)
    finally:
        runner.close()


def test_the_event_loop_starts_with_what_the_process_holds_frozen_out_of_the_collector(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    gc.unfreeze()  # (an earlier test's runtime may have frozen this test process already)
    app.enqueue_many("async_effect", [{"seconds": 0.01}])
    assert runner.execute(body(claim_all(effects)))["started"] == 1
    assert gc.get_freeze_count() > 10_000  # modules, the app, its engines: not walked again


def test_the_same_async_message_twice_runs_each_job_once(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ids = app.enqueue_many("async_effect", [{}] * 3)
    message = body(claim_all(effects))
    assert runner.execute(message)["started"] == 3
    assert runner.execute(message) == {"started": 0, "suppressed": 3, "lost": 0, "deferred": 0}
    assert all(effect_count(effects, i) == 1 for i in ids)


def test_an_async_job_that_needs_no_key_is_held_and_started_in_one_write(
    app: Harvest, runner: Runner, effects: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job with no key pool and no rate limit has nothing to wait for between its hold and
    its start: its delivery is taken by the start itself (one row write, not two). Its
    attempt is counted once; the same message again is suppressed as a duplicate; a job whose
    cancellation was asked before it started ends cancelled without running."""
    written: list[str] = []
    kinds = {sql._HOLD: "hold", sql._START: "start", sql._FINISH: "finish"}
    real = sql.arun

    async def counted(conn: Any, query: sql.Query[Any]) -> Any:
        written.append(kinds.get(query.sql, "other"))
        return await real(conn, query)

    monkeypatch.setattr(sql, "arun", counted)
    ids = app.enqueue_many("async_effect", [{}] * 3)
    app.cancel(ids[2])  # before it is claimed: never runs
    claimed = claim_all(effects)
    with effects.begin() as conn:  # a cancel asked after the claim, before the start
        conn.execute(text("UPDATE harvest_jobs SET cancel_requested = true WHERE id = :i"),
                     {"i": ids[1]})  # fmt: skip
    assert len(claimed) == 2
    message = [[c.id, str(c.token), c.name] for c in claimed]  # as the dispatcher sends it
    assert runner.execute(message)["started"] == 1
    assert "hold" not in written, written
    assert written.count("start") >= 1 and written.count("finish") >= 1
    assert runner.execute(message)["suppressed"] == 2  # both ended: neither runs again
    assert effect_count(effects, ids[0]) == 1 and effect_count(effects, ids[1]) == 0
    assert [job_row(effects, i).status for i in ids] == [
        JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.CANCELLED,
    ]  # fmt: skip
    assert job_row(effects, ids[0]).attempts == 1 and job_row(effects, ids[1]).attempts == 0


def test_an_async_job_past_its_time_limit_is_stopped_and_retried(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("async_timed_out", {})
    started = time.monotonic()
    runner.execute(body(claim_all(effects)))
    assert time.monotonic() - started < 5  # stopped at 0.5 s, not after its 30 s sleep
    job = job_row(effects, ref.id)
    assert job.status is JobStatus.PENDING and job.attempts == 1
    assert job.last_error is not None and job.last_error.startswith("JobTimeout")
    assert job.started_at is not None and job.run_at > job.started_at  # retried after a backoff


def test_an_async_job_that_ignores_its_time_limit_ends_timed_out_only_once_it_returns(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    # Its attempt may not end (and the job be retried, its key given to another) while the
    # handler still runs: it would call on. Abandoning it after a grace (5 s) did just that.
    ref = app.enqueue("async_stubborn", {"keeps_on": 5.5})
    runner.execute(body(claim_all(effects)))
    job = job_row(effects, ref.id)
    assert job.status is JobStatus.FAILED
    assert job.last_error is not None and job.last_error.startswith("JobTimeout")
    with effects.connect() as conn:
        recorded = conn.execute(
            text("SELECT at FROM test_effects WHERE job_id = :id"), {"id": ref.id}
        ).scalar_one()
    assert job.finished_at is not None and recorded <= job.finished_at


def test_cancelling_a_running_async_job_stops_it_within_a_heartbeat(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("async_cancellable", {"seconds": 60})
    message = body(claim_all(effects))
    worker = threading.Thread(target=runner.execute, args=(message,))
    worker.start()
    deadline = time.monotonic() + 10
    while effect_count(effects, ref.id) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    asked = time.monotonic()
    app.cancel(ref.id)
    worker.join(10)
    assert not worker.is_alive()
    assert time.monotonic() - asked < 3  # heartbeats every 0.5 s
    job = job_row(effects, ref.id)
    assert job.status is JobStatus.CANCELLED and job.result is None


def test_a_sync_job_on_a_thread_ends_timed_out_at_its_deadline_and_its_late_result_is_dropped(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    release = threading.Event()

    @app.job("stuck_thread", timeout=0.5, max_attempts=1)
    def stuck_thread(ctx: JobContext) -> dict[str, str]:
        release.wait(20)
        return {"late": "result"}

    ref = app.enqueue("stuck_thread", {})
    message = body(claim_all(effects))
    worker = threading.Thread(target=runner.execute, args=(message,))  # not the main thread
    worker.start()
    deadline = time.monotonic() + 10
    while job_row(effects, ref.id).status is not JobStatus.FAILED and time.monotonic() < deadline:
        time.sleep(0.05)
    job = job_row(effects, ref.id)
    assert job.status is JobStatus.FAILED and job.last_error is not None
    assert job.last_error.startswith("JobTimeout")
    assert job.started_at is not None and job.finished_at is not None
    assert (job.finished_at - job.started_at).total_seconds() < 1.5  # at its deadline
    assert worker.is_alive()  # Python cannot stop the thread: it runs on
    release.set()
    worker.join(10)
    after = job_row(effects, ref.id)
    assert after.status is JobStatus.FAILED and after.result is None  # the late result dropped


def test_an_unknown_job_is_deferred_without_an_attempt_then_failed(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("echo", {"value": 1})
    with effects.begin() as conn:  # a job only a newer worker knows
        conn.execute(
            text("UPDATE harvest_jobs SET name = 'from_the_future' WHERE id = :id"), {"id": ref.id}
        )
    assert runner.execute(body(claim_all(effects)))["deferred"] == 1
    job = job_row(effects, ref.id)
    assert job.status is JobStatus.PENDING and job.attempts == 0
    assert job.last_error is not None and "unknown job 'from_the_future'" in job.last_error
    with effects.begin() as conn:  # its grace is over
        conn.execute(
            text(
                "UPDATE harvest_jobs SET run_at = now(), deferred_since = now() - interval '2 min'"
                " WHERE id = :id"
            ),
            {"id": ref.id},
        )
    assert runner.execute(body(claim_all(effects)))["started"] == 1
    job = job_row(effects, ref.id)
    assert job.status is JobStatus.FAILED and job.attempts == 1
    assert job.last_error is not None and job.last_error.startswith("UnknownJob")
