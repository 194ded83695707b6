"""Fenced execution with the Runner in-process (no Celery): duplicates and stale tokens change
nothing, rescue takes back expired leases, and a lost lease drops the outcome (and is counted)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from harvest import dispatcher, store
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.coordination import keys as rkeys
from harvest.jobs import Claimed, Job
from harvest.models import JobStatus
from harvest.runner import DUPLICATES, LOST, MALFORMED, Runner
from tests.helpers import body, claim_all, effect_count, statement_kinds


@pytest.fixture
def app(jobs_app: Callable[..., Harvest]) -> Harvest:
    return jobs_app()


def job(engine: Engine, job_id: int) -> Job:
    with engine.connect() as conn:
        found = store.get(conn, job_id)
    assert found is not None
    return found


def counter(engine: Engine, name: str) -> int:
    with engine.connect() as conn:
        return store.counters(conn).get(name, 0)


def expire(engine: Engine, job_id: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE harvest_jobs SET lease_expires_at = now() - interval '1 s' WHERE id = :id"
            ),
            {"id": job_id},
        )


def rescue(engine: Engine) -> store.Rescued:
    with engine.begin() as conn:
        return store.rescue_expired(conn, limit=100)


def start(engine: Engine, claimed: Claimed) -> int:
    """Start a claimed job as a worker would; returns its attempt number."""
    with engine.begin() as conn:
        started = store.start(conn, claimed.id, claimed.token, ttl=300)
    assert started is not None
    return started.attempt


def steal(engine: Engine, job_id: int) -> uuid.UUID:
    """What happens to a paused worker: its lease expires, rescue takes the job back, the
    dispatcher claims it again. Returns the new owner's token."""
    expire(engine, job_id)
    assert job_id in rescue(engine).requeued
    claimed = claim_all(engine)
    assert [c.id for c in claimed] == [job_id]
    return claimed[0].token


# --- duplicates -----------------------------------------------------------------------------


def test_same_message_twice_runs_the_handler_once(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("effect", {})
    message = body(claim_all(effects))
    assert runner.execute(message) == {"started": 1, "suppressed": 0, "lost": 0, "deferred": 0}
    assert runner.execute(message) == {"started": 0, "suppressed": 1, "lost": 0, "deferred": 0}
    assert effect_count(effects, ref.id) == 1
    assert counter(effects, DUPLICATES) == 1
    done = job(effects, ref.id)
    assert (done.status, done.attempts) == (JobStatus.SUCCEEDED, 1)


def test_redelivery_while_the_first_delivery_runs_is_suppressed_and_counted(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    """A two-job message is delivered again (to a second worker) while the first worker is
    running its first job. Each job runs once, and both suppressed deliveries are counted."""
    second_worker = Runner(app)
    message: list[list[Any]] = []
    inner: dict[str, Any] = {}

    @app.job("redeliver")
    def redeliver(ctx: JobContext) -> None:
        inner["counts"] = second_worker.execute(message)

    try:
        first = app.enqueue("redeliver", {}, priority=10)
        second = app.enqueue("effect", {})
        message.extend(body(claim_all(effects)))
        assert [m[0] for m in message] == [first.id, second.id]
        outer = runner.execute(message)
    finally:
        second_worker.close()  # its heartbeat and its presence in the worker registry

    assert effect_count(effects, second.id) == 1
    assert job(effects, first.id).status is JobStatus.SUCCEEDED
    assert job(effects, second.id).status is JobStatus.SUCCEEDED
    assert outer["started"] + inner["counts"]["started"] == 2
    # Delivery 2 of job 1 (to the second worker) and delivery 1 of job 2 (to the first worker,
    # after the second had run it) were both refused.
    assert counter(effects, DUPLICATES) == 2


def test_delivery_with_a_stale_token_is_refused(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("effect", {})
    old = claim_all(effects)
    new_token = steal(effects, ref.id)  # the dispatch lease expired before a worker took it
    assert runner.execute(body(old)) == {"started": 0, "suppressed": 1, "lost": 0, "deferred": 0}
    assert effect_count(effects, ref.id) == 0
    assert runner.execute([[ref.id, str(new_token)]])["started"] == 1
    assert effect_count(effects, ref.id) == 1
    assert job(effects, ref.id).status is JobStatus.SUCCEEDED


@pytest.mark.parametrize(
    "message", ["not a list", [], [[1]], [["1", str(uuid.uuid4())]], [[True, str(uuid.uuid4())]]]
)
def test_malformed_message_is_dropped_and_counted(
    app: Harvest, runner: Runner, effects: Engine, message: Any
) -> None:
    assert runner.execute(message) == {"started": 0, "suppressed": 0, "lost": 0, "deferred": 0}
    assert counter(effects, MALFORMED) == 1


# --- stale tokens ---------------------------------------------------------------------------


def test_finish_with_an_old_token_changes_nothing(app: Harvest, effects: Engine) -> None:
    ref = app.enqueue("noop", {})
    [first] = claim_all(effects)
    assert start(effects, first) == 1
    new_token = steal(effects, ref.id)
    assert job(effects, ref.id).attempts == 1
    assert start(effects, Claimed(ref.id, new_token, "execution")) == 2

    with effects.begin() as conn:
        assert not store.finish(
            conn, ref.id, first.token, status=JobStatus.FAILED, error="stale attempt 1"
        )
    running = job(effects, ref.id)
    assert (running.status, running.attempts) == (JobStatus.RUNNING, 2)

    with effects.begin() as conn:
        assert store.finish(
            conn, ref.id, new_token, status=JobStatus.SUCCEEDED, result_json='{"by": 2}'
        )
    with effects.begin() as conn:
        assert not store.finish(
            conn, ref.id, first.token, status=JobStatus.FAILED, error="stale attempt 1"
        )
        assert not store.finish(conn, ref.id, new_token, status=JobStatus.FAILED, error="twice")
    done = job(effects, ref.id)
    assert (done.status, done.result, done.last_error) == (JobStatus.SUCCEEDED, {"by": 2}, None)


def test_heartbeat_with_a_stale_token_extends_nothing(app: Harvest, effects: Engine) -> None:
    ref = app.enqueue("noop", {})
    [first] = claim_all(effects)
    start(effects, first)
    new_token = steal(effects, ref.id)
    start(effects, Claimed(ref.id, new_token, "execution"))
    before = job(effects, ref.id).lease_expires_at
    assert before is not None

    with effects.begin() as conn:
        assert store.heartbeat(conn, [(ref.id, first.token)], ttl=3600) == {}
    assert job(effects, ref.id).lease_expires_at == before

    with effects.begin() as conn:  # the holder's own heartbeat does extend it
        assert store.heartbeat(conn, [(ref.id, new_token)], ttl=3600) == {ref.id: False}
    after = job(effects, ref.id).lease_expires_at
    assert after is not None
    assert (after - before).total_seconds() > 3000


# --- rescue ---------------------------------------------------------------------------------


def test_rescue_requeues_an_expired_running_job_keeping_its_attempts(
    app: Harvest, effects: Engine
) -> None:
    ref = app.enqueue("noop", {}, max_attempts=3)
    [claimed] = claim_all(effects)
    start(effects, claimed)
    assert rescue(effects).requeued == []  # the lease is still live
    expire(effects, ref.id)
    assert rescue(effects).requeued == [ref.id]
    back = job(effects, ref.id)
    assert back.status is JobStatus.PENDING
    assert back.attempts == 1
    assert back.lease_expires_at is None
    assert back.finished_at is None
    assert back.last_error is not None and "lease expired" in back.last_error
    again = claim_all(effects)
    assert [c.id for c in again] == [ref.id]
    assert again[0].token != claimed.token


def test_a_rescued_job_is_claimed_ahead_of_the_backlog_enqueued_after_it(
    app: Harvest, effects: Engine
) -> None:
    first = app.enqueue("noop", {})
    [claimed] = claim_all(effects)
    start(effects, claimed)  # its worker dies here
    later = app.enqueue_many("noop", [{}] * 20)
    expire(effects, first.id)
    assert rescue(effects).requeued == [first.id]
    with effects.begin() as conn:
        again = store.claim_due(conn, limit=1, ttl=300)
    assert [c.id for c in again] == [first.id], f"queued behind {len(later)} later jobs"


def test_rescue_fails_an_expired_job_on_its_last_attempt(app: Harvest, effects: Engine) -> None:
    ref = app.enqueue("noop", {}, max_attempts=2)
    [claimed] = claim_all(effects)
    start(effects, claimed)
    token = steal(effects, ref.id)
    assert start(effects, Claimed(ref.id, token, "execution")) == 2
    expire(effects, ref.id)
    assert rescue(effects).failed == [ref.id]
    dead = job(effects, ref.id)
    assert dead.status is JobStatus.FAILED
    assert dead.attempts == 2
    assert dead.finished_at is not None
    assert dead.last_error is not None and "attempt 2" in dead.last_error
    assert claim_all(effects) == []


def test_rescue_requeues_an_expired_dispatch_without_counting_an_attempt(
    app: Harvest, effects: Engine
) -> None:
    ref = app.enqueue("noop", {}, max_attempts=1)
    claim_all(effects)
    expire(effects, ref.id)
    assert rescue(effects).requeued == [ref.id]  # never started: not its last attempt yet
    back = job(effects, ref.id)
    assert (back.status, back.attempts) == (JobStatus.PENDING, 0)


def test_a_dispatch_tick_rescues_when_no_rescue_ran_for_an_interval(
    app: Harvest, effects: Engine
) -> None:
    """Rescue's own ticks can wait (and expire) behind dispatch ticks on the schedule queue;
    dispatch ticks run it when none ran for HARVEST_RESCUE_INTERVAL (chaos case F1)."""
    app.redis.delete(rkeys.rescue_ran())
    ref = app.enqueue("noop", {})
    [claimed] = claim_all(effects)
    start(effects, claimed)  # its worker dies here
    expire(effects, ref.id)
    report = dispatcher.rescue_if_due(app)
    assert report is not None and report.requeued == 1
    claim_all(effects)
    expire(effects, ref.id)  # its second worker dies too, at once
    assert dispatcher.rescue_if_due(app) is None  # one ran within the interval: not yet
    assert job(effects, ref.id).status is JobStatus.DISPATCHED
    app.redis.pexpire(rkeys.rescue_ran(), 1)  # the interval passes
    time.sleep(0.01)
    report = dispatcher.rescue_if_due(app)
    assert report is not None and report.requeued == 1
    dispatcher.rescue(app)  # a rescue tick of its own counts as one
    assert dispatcher.rescue_if_due(app) is None


# --- lost leases ----------------------------------------------------------------------------


def test_outcome_after_the_lease_was_taken_is_dropped_and_counted(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    thief: dict[str, uuid.UUID] = {}

    @app.job("paused_then_done")
    def paused_then_done(ctx: JobContext) -> dict[str, str]:
        thief["token"] = steal(effects, ctx.job_id)
        return {"from": "the old attempt"}

    ref = app.enqueue("paused_then_done", {})
    assert runner.execute(body(claim_all(effects))) == {
        "started": 1,
        "suppressed": 0,
        "lost": 1,
        "deferred": 0,
    }
    assert counter(effects, LOST) == 1
    now = job(effects, ref.id)
    assert now.status is JobStatus.DISPATCHED  # owned by the newer claim, outcome not written
    assert now.result is None
    with effects.connect() as conn:
        token = conn.execute(
            text("SELECT lease_token FROM harvest_jobs WHERE id = :id"), {"id": ref.id}
        ).scalar_one()
    assert token == thief["token"]


def test_lost_lease_noticed_by_the_heartbeat_is_counted(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    """Same loss, but the heartbeat notices it first (the usual case for a long job): the
    outcome is dropped, and 'lost_outcomes_dropped' must count it all the same."""

    @app.job("paused_long")
    def paused_long(ctx: JobContext) -> None:
        steal(effects, ctx.job_id)
        runner.heartbeat.beat()  # the next renewal round finds the lease gone

    ref = app.enqueue("paused_long", {})
    counts = runner.execute(body(claim_all(effects)))
    assert counts["lost"] == 1
    assert job(effects, ref.id).status is JobStatus.DISPATCHED
    assert counter(effects, LOST) == 1


# --- cancel ---------------------------------------------------------------------------------


def test_cancel_of_a_dispatched_job_ends_it_cancelled_without_running(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    ref = app.enqueue("effect", {})
    message = body(claim_all(effects))
    assert app.cancel(ref.id) is JobStatus.DISPATCHED  # asked; the worker ends it
    counts = runner.execute(message)
    assert counts["started"] == 0
    assert effect_count(effects, ref.id) == 0
    ended = job(effects, ref.id)
    assert ended.status is JobStatus.CANCELLED
    assert ended.finished_at is not None
    assert app.wait(ref.id, timeout=1).status is JobStatus.CANCELLED


# --- a message's jobs one after another -----------------------------------------------------


def test_a_jobs_end_and_the_next_ones_start_go_in_one_statement(
    app: Harvest, runner: Runner, effects: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five jobs of one message (each longer than the write linger: it connects to Postgres),
    named as the dispatcher names them: the first held and started in one write (it needs
    nothing of the gate), the others held, four 'end one, start the next', one end: seven
    statements where eleven were, and every job ran once and succeeded."""
    refs = [app.enqueue("effect", {}) for _ in range(5)]
    message = [[c.id, str(c.token), c.name] for c in claim_all(effects)]
    sent = statement_kinds(runner, monkeypatch)
    assert runner.execute(message)["started"] == 5
    assert sent == ["start", "hold", *["finish+start"] * 4, "finish"]
    ended = [job(effects, r.id) for r in refs]
    assert [effect_count(effects, r.id) for r in refs] == [1] * 5
    assert {(j.status, j.attempts) for j in ended} == {(JobStatus.SUCCEEDED, 1)}
    for before, after in itertools.pairwise(ended):
        assert after.started_at == before.finished_at  # one statement, one now()


def test_a_next_job_taken_meanwhile_is_suppressed_and_the_one_before_still_ends(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    """The combined statement fences each half alone: while job 1 runs, job 2 is rescued and
    claimed again (another worker's now). Job 1's end is written; job 2 is not started here."""
    taken: dict[str, uuid.UUID] = {}

    @app.job("takes_the_next")
    def takes_the_next(ctx: JobContext, other: int = 0) -> dict[str, int]:
        taken["token"] = steal(effects, other)
        return {"ran": ctx.job_id}

    second = app.enqueue("effect", {}, priority=1)
    first = app.enqueue("takes_the_next", {"other": second.id}, priority=10)
    message = body(claim_all(effects))
    assert [m[0] for m in message] == [first.id, second.id]
    counts = runner.execute(message)
    assert (counts["started"], counts["suppressed"]) == (1, 1)
    assert job(effects, first.id).status is JobStatus.SUCCEEDED
    assert job(effects, first.id).result == {"ran": first.id}
    assert effect_count(effects, second.id) == 0
    again = job(effects, second.id)
    assert (again.status, again.attempts) == (JobStatus.DISPATCHED, 0)  # the new owner's
    assert counter(effects, DUPLICATES) == 1


def test_an_end_that_fails_its_fence_does_not_keep_the_next_job_from_starting(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    @app.job("paused_first")
    def paused_first(ctx: JobContext) -> None:
        steal(effects, ctx.job_id)

    first = app.enqueue("paused_first", {}, priority=10)
    second = app.enqueue("effect", {}, priority=1)
    counts = runner.execute(body(claim_all(effects)))
    assert (counts["started"], counts["lost"]) == (2, 1)
    assert job(effects, first.id).status is JobStatus.DISPATCHED  # the newer claim's
    assert job(effects, second.id).status is JobStatus.SUCCEEDED
    assert effect_count(effects, second.id) == 1
    assert counter(effects, LOST) == 1
