"""The core of execution decides everything about a held job without I/O: driven here by a
scripted shell that answers each effect, so every path is checked in microseconds."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any

import psycopg
import pytest
import redis

from harvest.app import JobSpec
from harvest.coordination.key_pool import Busy, Lease
from harvest.errors import KeyRejected, LeaseLost, RateLimited
from harvest.execution import away, core, delivery, patience, tracking
from harvest.execution import effects as fx
from harvest.execution.observe import AttemptEnded, AttemptStarted, Deferred
from harvest.jobs import Started
from harvest.models import JobStatus
from harvest.outage import Outages
from harvest.retry import RetryPolicy

PLAN = core.Plan(
    worker="host:1", key_wait=1.0, unknown_job_grace=60.0, retry_base=1.0, lease_ttl=30.0
)
TOKEN = uuid.uuid4()


def spec(
    pool: str | None = None, rate: str | None = None, attempts: int = 3, cost: Any = None
) -> JobSpec:
    return JobSpec(
        "j", lambda ctx: None, "execution", attempts, 10.0, (Exception,),
        RetryPolicy(base=2.0, jitter=0.0), pool, rate, cost=cost,
    )  # fmt: skip


def started(attempt: int = 1, max_attempts: int = 3) -> Started:
    return Started(7, TOKEN, "j", {}, attempt, max_attempts, 10.0, False)


class Script:
    """Answers effects from a table of callables; records every effect it saw. An answer that
    raises is thrown into the generator, as a shell throws a failed effect's error."""

    def __init__(self, **answers: Callable[[Any], Any]) -> None:
        self.answers = answers
        self.seen: list[Any] = []
        self.clock = 0.0

    def run(self, gen: Generator[Any, Any, Any]) -> Any:
        value: Any = None
        error: Exception | None = None
        while True:
            try:
                effect = gen.throw(error) if error is not None else gen.send(value)
            except StopIteration as stop:
                return stop.value
            self.seen.append(effect)
            name = type(effect).__name__
            value, error = None, None
            if name == "Clock":
                value = self.clock
            elif name == "AwaitKey":
                self.clock += effect.seconds
            else:
                try:
                    value = self.answers.get(name, lambda e: None)(effect)
                except Exception as exc:
                    error = exc

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.seen if isinstance(e, kind)]


def tracked() -> tracking.Tracked:
    return tracking.Tracked(7, TOKEN, "j", 1, max_attempts=3)


def lease(key: int = 1) -> Lease:
    return Lease("p", key, "tok", 5, 1e9)


def test_a_success_is_started_run_finished_and_reported() -> None:
    s = Script(Start=lambda e: started(), RunHandler=lambda e: fx.HandlerResult(value={"ok": 1}),
               Finish=lambda e: True)  # fmt: skip
    assert s.run(core.attempt(tracked(), spec(), PLAN)) == ("started",)
    (finish,) = s.of(fx.Finish)
    assert finish.row.status is JobStatus.SUCCEEDED and finish.row.result_json == '{"ok": 1}'
    events = [type(n.event) for n in s.of(fx.Notify)]
    assert events == [AttemptStarted, AttemptEnded]


def test_a_duplicate_delivery_stops_at_the_start_and_is_counted() -> None:
    s = Script(Start=lambda e: None)
    assert s.run(core.attempt(tracked(), spec(), PLAN)) == ("suppressed",)
    assert [b.name for b in s.of(fx.Bump)] == [core.DUPLICATES]
    assert not s.of(fx.RunHandler)


def test_a_refused_finish_counts_the_outcome_as_lost() -> None:
    s = Script(Start=lambda e: started(), RunHandler=lambda e: fx.HandlerResult(value=None),
               Finish=lambda e: False)  # fmt: skip
    assert s.run(core.attempt(tracked(), spec(), PLAN)) == ("started", "lost")
    assert [b.name for b in s.of(fx.Bump)] == [core.LOST]


def test_a_job_lost_while_it_waited_never_starts() -> None:
    t = tracked()
    t.lost = True
    s = Script()
    assert s.run(core.attempt(t, spec(), PLAN)) == ("lost",)
    assert not s.of(fx.Start)


def test_a_failure_retries_with_the_policy_then_fails_on_the_last_attempt() -> None:
    boom = fx.HandlerResult(error=RuntimeError("boom"))
    s = Script(Start=lambda e: started(1), RunHandler=lambda e: boom, Finish=lambda e: True)
    s.run(core.attempt(tracked(), spec(), PLAN))
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.PENDING and row.retry_delay == 2.0 and not row.refund_attempt
    s = Script(Start=lambda e: started(3), RunHandler=lambda e: boom, Finish=lambda e: True)
    s.run(core.attempt(tracked(), spec(), PLAN))
    assert s.of(fx.Finish)[0].row.status is JobStatus.FAILED


def test_a_timeout_is_a_job_timeout_through_the_retry_policy() -> None:
    s = Script(Start=lambda e: started(), RunHandler=lambda e: fx.HandlerResult(timed_out=True),
               Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), spec(), PLAN))
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.PENDING and row.error is not None
    assert row.error.startswith("JobTimeout")


@pytest.mark.parametrize(
    ("error", "effect"), [(RateLimited(12.0), fx.CoolKey), (KeyRejected("401"), fx.DisableKey)]
)
def test_the_keys_fault_rests_or_disables_the_key_and_uses_no_attempt(
    error: Exception, effect: type
) -> None:
    result = fx.HandlerResult(error=error)
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(),
               RunHandler=lambda e: result, Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), spec(pool="p"), PLAN))
    assert len(s.of(effect)) == 1
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.PENDING and row.refund_attempt
    order = [type(e) for e in s.seen]
    assert order.count(fx.ReleaseKey) == 1  # given back once, before the write (free sooner)
    assert order.index(effect) < order.index(fx.ReleaseKey) < order.index(fx.Finish)


def test_no_key_within_key_wait_steps_back_with_its_attempt_refunded() -> None:
    s = Script(Start=lambda e: started(), LeaseKey=lambda e: Busy(0.3), Defer=lambda e: True)
    assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("deferred",)
    assert len(s.of(fx.Start)) == 1  # started once, before it waited
    assert len(s.of(fx.LeaseKey)) == 5  # tried every 0.25 s for key_wait = 1 s
    (defer,) = s.of(fx.Defer)
    assert defer.row.started  # the statement refunds the attempt begun for the wait
    assert [type(n.event) for n in s.of(fx.Notify)] == [Deferred]
    assert not s.of(fx.RunHandler)


def test_a_job_that_waits_for_its_key_starts_first_and_goes_straight_to_its_call() -> None:
    answers = iter([Busy(0.3), Busy(0.3), lease()])
    s = Script(Start=lambda e: started(), LeaseKey=lambda e: next(answers),
               RunHandler=lambda e: fx.HandlerResult(value=1), Finish=lambda e: True)  # fmt: skip
    assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("started",)
    order = [type(e) for e in s.seen]
    assert order.count(fx.Start) == 1
    assert order.index(fx.Start) < order.index(fx.AwaitKey)
    granted = len(order) - 1 - order[::-1].index(fx.LeaseKey)
    between = order[granted + 1 : order.index(fx.RunHandler)]
    assert fx.Start not in between and fx.Finish not in between  # no write between key and call


def test_a_job_on_its_last_attempt_waits_for_its_key_unstarted() -> None:
    # rescue fails a running job that used its attempts: a worker killed while this one waits
    # must not fail it, since it never called
    t = tracked()
    t.attempt = 3
    answers = iter([Busy(0.3), lease()])
    s = Script(Start=lambda e: started(3), LeaseKey=lambda e: next(answers),
               RunHandler=lambda e: fx.HandlerResult(value=1), Finish=lambda e: True)  # fmt: skip
    assert s.run(core.attempt(t, spec(pool="p"), PLAN)) == ("started",)
    order = [type(e) for e in s.seen]
    assert order.index(fx.AwaitKey) < order.index(fx.Start)


def test_a_job_that_gets_a_key_at_once_starts_after_the_lease() -> None:
    s = Script(Start=lambda e: started(), LeaseKey=lambda e: lease(),
               RunHandler=lambda e: fx.HandlerResult(value=1), Finish=lambda e: True)  # fmt: skip
    assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("started",)
    order = [type(e) for e in s.seen]
    assert order.index(fx.LeaseKey) < order.index(fx.Start) and fx.AwaitKey not in order


def test_a_duplicate_found_when_it_starts_to_wait_for_a_key_stops_there() -> None:
    s = Script(Start=lambda e: None, LeaseKey=lambda e: Busy(0.3))
    assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("suppressed",)
    assert [b.name for b in s.of(fx.Bump)] == [core.DUPLICATES]
    assert not s.of(fx.AwaitKey) and not s.of(fx.Defer) and not s.of(fx.RunHandler)


@pytest.mark.parametrize("what", ["cancelled", "lost"])
def test_a_job_cancelled_or_lost_while_it_waited_for_its_key_makes_no_call(what: str) -> None:
    t = tracked()
    tries: list[int] = []

    def after_a_wait(e: Any) -> Any:
        tries.append(1)
        if len(tries) == 1:
            return Busy(0.3)
        if what == "cancelled":
            t.cancel.set()  # the heartbeat saw the request while it waited
        else:
            t.lost = True  # the heartbeat found its lease gone
        return lease()

    s = Script(Start=lambda e: started(), LeaseKey=after_a_wait, Finish=lambda e: True)
    counts = s.run(core.attempt(t, spec(pool="p"), PLAN))
    assert s.of(fx.AwaitKey)  # it did wait
    assert not s.of(fx.RunHandler) and not s.of(fx.CountUsage)
    assert [r.used for r in s.of(fx.ReleaseKey)] == [0]  # its key back, nothing used
    if what == "cancelled":
        assert counts == ("started",)
        assert s.of(fx.Finish)[0].row.status is JobStatus.CANCELLED
    else:
        assert counts == ("started", "lost") and not s.of(fx.Finish)


def test_a_deferral_for_busy_keys_lasts_no_longer_than_the_wait() -> None:
    # Keys at their concurrency answer the earliest lease expiry (25 s), where a call may end
    # any moment: the job is back in key_wait at most, not behind 25 s of the queue.
    s = Script(Start=lambda e: started(), LeaseKey=lambda e: Busy(25.0), Defer=lambda e: True)
    assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("deferred",)
    assert s.of(fx.Defer)[0].row.delay == PLAN.key_wait
    short = Script(Start=lambda e: started(), LeaseKey=lambda e: Busy(0.3),
                   Defer=lambda e: True)  # fmt: skip
    short.run(core.attempt(tracked(), spec(pool="p"), PLAN))
    assert short.of(fx.Defer)[0].row.delay == 0.3  # a sooner bound is kept


def test_a_pool_redis_lost_is_rebuilt_once() -> None:
    answers = iter([None, lease()])
    s = Script(LeaseKey=lambda e: next(answers), Start=lambda e: None)
    s.run(core.attempt(tracked(), spec(pool="p"), PLAN))
    assert len(s.of(fx.LoadPool)) == 1 and s.of(fx.ReleaseKey)


REFUSED = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def _away(e: Any) -> Any:
    raise REFUSED


@pytest.mark.parametrize("where", ["RatePermit", "LeaseKey", "LoadPool", "waiting"])
def test_redis_away_at_the_gate_steps_the_job_back_with_its_attempt_refunded(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis stopped or restarted under a job at its gate: no error out of the attempt (it
    # would end the task with a traceback and leave the job to rescue), no attempt used.
    def script() -> Script:
        answers: dict[str, Callable[[Any], Any]] = {
            "Defer": lambda e: True,
            "Start": lambda e: started(),
        }
        if where == "LoadPool":
            answers["LeaseKey"] = lambda e: None  # the pool is gone from Redis: rebuilt: fails
        if where == "waiting":  # it started, waited for a key, then Redis went
            tries = iter([Busy(0.3)])
            answers["LeaseKey"] = lambda e: next(tries, None) or _away(e)
        else:
            answers[where] = _away
        return Script(**answers)

    caplog.set_level("WARNING", "harvest.runner")
    job = spec(pool="p", rate="10/s" if where == "RatePermit" else None)
    runs = [script() for _ in range(3)]
    with _fresh_outages():
        for s in runs:
            assert s.run(core.attempt(tracked(), job, PLAN, deferred_for=2.0)) == ("deferred",)
    defers = [d for s in runs for d in s.of(fx.Defer)]
    assert len(defers) == 3 and {d.row.delay for d in defers} == {1.0}
    assert all(d.row.started == (where == "waiting") for d in defers)  # begun: refunded
    assert not any(s.of(fx.RunHandler) or s.of(fx.Finish) for s in runs)
    said = [r.getMessage() for r in caplog.records if "Redis" in r.getMessage()]
    assert len(said) == 1, said  # once per outage, not once per job
    assert "Redis does not answer (ConnectionError: Error 111" in said[0]
    assert "rate permit or key lease" in said[0]


def test_the_step_back_for_redis_away_grows_with_the_outage_then_its_end_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", "harvest.runner")
    with _fresh_outages():
        waits = []
        for deferred_for in (0.0, 8.0, 60.0, 600.0):
            s = Script(LeaseKey=_away, Defer=lambda e: True)
            s.run(core.attempt(tracked(), spec(pool="p"), PLAN, deferred_for=deferred_for))
            waits.append(s.of(fx.Defer)[0].row.delay)
        assert waits == [1.0, 2.0, 15.0, 30.0]
        ok = fx.HandlerResult(value=1)
        s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(),
                   RunHandler=lambda e: ok, Finish=lambda e: True)  # fmt: skip
        assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("started",)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[1].startswith("Redis answers again after")
    assert "(4 failed key-pool calls meanwhile)" in said[1]


@pytest.mark.parametrize(
    ("error", "effect"), [(RateLimited(12.0), "CoolKey"), (KeyRejected("401"), "DisableKey")]
)
def test_redis_away_after_the_call_still_writes_the_outcome(error: Exception, effect: str) -> None:
    # The call was made: its outcome must be written, or rescue would run it again.
    result = fx.HandlerResult(error=error)
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(),
               RunHandler=lambda e: result, Finish=lambda e: True, **{effect: _away})  # fmt: skip
    with _fresh_outages():
        assert s.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("started",)
    (finish,) = s.of(fx.Finish)
    assert finish.row.status is JobStatus.PENDING and finish.row.refund_attempt
    assert len(s.of(fx.ReleaseKey)) == 1  # the key is still given back (or expires)


def test_redis_away_at_a_lease_before_the_hold_goes_on_to_the_gate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", "harvest.runner")
    with _fresh_outages():
        s = Script(LeaseKey=_away)
        assert s.run(delivery.key_first((7, TOKEN), spec(pool="p"), PLAN)) is None
        assert not s.of(fx.Start)
        gated = Script(LeaseKey=_away, Defer=lambda e: True)  # the gate meets it, and says so
        assert gated.run(core.attempt(tracked(), spec(pool="p"), PLAN)) == ("deferred",)
        back = Script(LeaseKey=lambda e: lease(), Start=lambda e: started())
        assert isinstance(back.run(delivery.key_first((7, TOKEN), spec(pool="p"), PLAN)),
                          delivery.Keyed)  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[1].startswith("Redis answers again"), said


@contextlib.contextmanager
def _fresh_outages() -> Iterator[None]:
    """The process's outage state, empty for the test and restored after it."""
    saved = away.outages
    away.outages = Outages(away.log, "key-pool calls")
    try:
        yield
    finally:
        away.outages = saved


@pytest.mark.parametrize(
    ("renewal", "held", "io"),
    [
        ("fresh", True, False),  # renewed lately: trusted without asking Redis
        ("renewed", True, True),  # stale: asked, still ours, fresh again
        ("taken", False, True),  # stale: asked, gone (a paused process): no call
        ("away", False, True),  # stale: Redis does not answer: cannot tell, no call
    ],
)
def test_the_key_check_before_a_call_asks_redis_only_when_the_lease_is_stale(
    renewal: str, held: bool, io: bool, caplog: pytest.LogCaptureFixture
) -> None:
    t = tracked()
    t.key_lease = lease(3)
    t.key_renewed(sent_at=0.0, ttl=PLAN.lease_ttl)
    answers = {"renewed": lambda e: True, "taken": lambda e: False, "away": _away}
    s = Script(RenewKey=answers.get(renewal, lambda e: True))
    s.clock = 1.0 if renewal == "fresh" else PLAN.lease_ttl
    caplog.set_level("WARNING")
    with _fresh_outages():
        assert s.run(tracking.key_still_held(t, PLAN.lease_ttl)) is held
        assert away.outages.away(away.REDIS) is (renewal == "away")
    assert [e.lease for e in s.of(fx.RenewKey)] == ([lease(3)] if io else [])
    assert t.key_fresh(s.clock + 1.0) is (renewal in ("fresh", "renewed"))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("key 3 of pool 'p' was lost" in said) is (renewal == "taken")
    assert ("Redis does not answer" in said) is (renewal == "away")


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_a_handler_stopped_by_its_key_check_retries_without_using_an_attempt(
    max_attempts: int,
) -> None:
    # ctx.client() raised LeaseLost: no call was made with the key. Even a last attempt retries.
    result = fx.HandlerResult(error=LeaseLost("this attempt's lease was lost"))
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(max_attempts, max_attempts),
               RunHandler=lambda e: result, Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), spec(pool="p", attempts=max_attempts), PLAN))
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.PENDING and row.refund_attempt
    assert not s.of(fx.CoolKey) and not s.of(fx.DisableKey)


def test_a_closed_rate_limit_defers() -> None:
    s = Script(RatePermit=lambda e: 4.0, Defer=lambda e: True)
    assert s.run(core.attempt(tracked(), spec(rate="1/s"), PLAN)) == ("deferred",)
    assert s.of(fx.Defer)[0].row.delay == 4.0


def test_an_unknown_job_is_deferred_until_its_grace_passes_then_fails() -> None:
    s = Script(Defer=lambda e: True)
    assert s.run(core.attempt(tracked(), None, PLAN, deferred_for=10.0)) == ("deferred",)
    assert "unknown job" in (s.of(fx.Defer)[0].row.reason or "")
    s = Script(Start=lambda e: started(), Finish=lambda e: True)
    assert s.run(core.attempt(tracked(), None, PLAN, deferred_for=61.0)) == ("started",)
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.FAILED and (row.error or "").startswith("UnknownJob")


def test_a_handler_ended_at_its_deadline_elsewhere_writes_nothing_more() -> None:
    result = fx.HandlerResult(value={"late": 1}, ended_elsewhere=True)
    s = Script(Start=lambda e: started(), RunHandler=lambda e: result)
    assert s.run(core.attempt(tracked(), spec(), PLAN)) == ("started",)
    assert not s.of(fx.Finish)


def test_handing_back_at_shutdown_defers_at_once_and_releases_the_key() -> None:
    t = tracked()
    t.handing_back = "the worker shut down"
    s = Script(Defer=lambda e: True)
    assert s.run(core.attempt(t, spec(pool="p"), PLAN)) == ("deferred",)
    assert s.of(fx.Defer)[0].row.delay == 0.0 and not s.of(fx.LeaseKey)
    handed = fx.HandlerResult(handed_back=True)
    s = Script(Start=lambda e: started(), RunHandler=lambda e: handed, Finish=lambda e: True)
    s.run(core.attempt(tracked(), spec(), PLAN))
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.PENDING and row.refund_attempt


def test_heartbeat_settles_lost_and_cancelled_but_not_jobs_that_are_finishing() -> None:
    a, b, c = (tracking.Tracked(i, uuid.uuid4()) for i in (1, 2, 3))
    c.finishing = True  # its own finish cleared the lease: no news
    lost, cancelled = tracking.settle([a, b, c], {2: True})
    assert lost == [a] and a.lost and cancelled == [b] and b.cancel.is_set() and not c.lost


def test_a_key_lease_is_trusted_without_io_only_while_fresh() -> None:
    t = tracking.Tracked(1, uuid.uuid4())
    t.key_renewed(sent_at=100.0, ttl=10.0)
    assert t.key_fresh(107.9) and not t.key_fresh(108.1)
    t.lost = True
    assert not t.key_fresh(101.0)


def test_a_key_given_back_during_a_renewal_round_is_no_news(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job whose handler ended while the round was in flight released its key (the renewal
    then finds no lease): no warning. One still holding its lease is warned about."""
    ended, running = tracking.Tracked(1, uuid.uuid4()), tracking.Tracked(2, uuid.uuid4())
    leases = [Lease("p", key_id, "t", 1, 0.0) for key_id in (11, 12)]
    ended.key_lease, running.key_lease = leases
    keyed = [(ended, leases[0]), (running, leases[1])]
    ended.key_lease = None  # released after the round was planned
    with caplog.at_level("WARNING", logger="harvest.heartbeat"):
        tracking.keys_renewed(keyed, [False, False], sent_at=5.0, ttl=10.0)
    assert [r.getMessage() for r in caplog.records] == ["key lease on key 12 of pool 'p' was lost"]
    tracking.keys_renewed([(running, leases[1])], [True], sent_at=5.0, ttl=10.0)
    assert running.key_fresh(12.9)


LOST_WARNING = "lease lost while running"


def test_a_renewal_that_misses_a_job_finished_meanwhile_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The race of issue 13: a heartbeat round picked job 7, its finish was recorded, then the
    renewal statement matched no row. No warning for a job whose finish was recorded."""
    job = tracked()
    renewal = tracking.renewal([job], 0.0)  # the heartbeat's snapshot: job 7 is due
    assert renewal.jobs == [job]

    def finish_then_renewal_misses(effect: Any) -> bool:
        tracking.settle(renewal.jobs, {})  # the renewal lands after the finish committed
        return True

    s = Script(Start=lambda e: started(), RunHandler=lambda e: fx.HandlerResult(value=None),
               Finish=finish_then_renewal_misses)  # fmt: skip
    with caplog.at_level("WARNING"):
        assert s.run(core.attempt(job, spec(), PLAN)) == ("started",)
    assert not job.lost and LOST_WARNING not in caplog.text


def test_a_renewal_that_misses_a_job_deferred_meanwhile_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = tracked()
    renewal = tracking.renewal([job], 0.0)

    def defer_then_renewal_misses(effect: Any) -> bool:
        tracking.settle(renewal.jobs, {})
        return True

    s = Script(RatePermit=lambda e: 5.0, Defer=defer_then_renewal_misses)
    with caplog.at_level("WARNING"):
        assert s.run(core.attempt(job, spec(rate="1/s"), PLAN)) == ("deferred",)
    assert not job.lost and "lease lost" not in caplog.text


def test_an_outcome_dropped_for_a_lost_lease_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = tracked()
    s = Script(Start=lambda e: started(), RunHandler=lambda e: fx.HandlerResult(value=None),
               Finish=lambda e: False)  # fmt: skip
    with caplog.at_level("WARNING"):
        s.run(core.attempt(job, spec(), PLAN))
    assert caplog.text.count(LOST_WARNING) == 1 and "job 7 attempt 1" in caplog.text


# --- token budgets ----------------------------------------------------------------------------


def costly(cost: Any) -> JobSpec:
    return JobSpec(
        "j", lambda ctx: None, "execution", 3, 10.0, (Exception,),
        RetryPolicy(base=2.0, jitter=0.0), "p", None, None, cost,
    )  # fmt: skip


def test_the_cost_is_reserved_at_the_lease_and_what_was_used_settled_at_the_release() -> None:
    def run(e: fx.RunHandler) -> fx.HandlerResult:
        e.tracked.used(300)  # what ctx.used(tokens=...) does
        e.tracked.used(20)
        return fx.HandlerResult(value=None)

    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(), RunHandler=run,
               Finish=lambda e: True)  # fmt: skip
    t = tracked()
    s.run(core.attempt(t, costly(lambda p: p["n"] * 2), PLAN, payload={"n": 500}))
    assert [e.cost for e in s.of(fx.LeaseKey)] == [1000]
    assert [e.used for e in s.of(fx.ReleaseKey)] == [320]


def test_a_handler_that_reports_nothing_leaves_its_reservation_standing() -> None:
    ran = fx.HandlerResult(value=None)
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(),
               RunHandler=lambda e: ran, Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), costly(700), PLAN))
    assert [e.cost for e in s.of(fx.LeaseKey)] == [700]
    assert [e.used for e in s.of(fx.ReleaseKey)] == [None]


def test_a_reservation_of_a_job_that_never_ran_is_refunded() -> None:
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: None)  # a duplicate delivery
    s.run(core.attempt(tracked(), costly(700), PLAN))
    assert [e.used for e in s.of(fx.ReleaseKey)] == [0]


def test_a_failing_cost_function_fails_the_job_without_a_key_a_call_or_a_retry() -> None:
    s = Script(Start=lambda e: started(1), Finish=lambda e: True)
    s.run(core.attempt(tracked(), costly(lambda p: p["missing"]), PLAN, payload={}))
    assert not s.of(fx.LeaseKey) and not s.of(fx.RunHandler)
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.FAILED and row.error is not None and "cost" in row.error
    s = Script(Start=lambda e: started(1), Finish=lambda e: True)
    s.run(core.attempt(tracked(), costly(lambda p: -5), PLAN, payload={}))
    assert "whole number" in (s.of(fx.Finish)[0].row.error or "")


def test_a_cost_above_every_keys_budget_fails_the_job_at_once() -> None:
    s = Script(LeaseKey=lambda e: Busy(1.0, never=True), Start=lambda e: started(1),
               Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), costly(5000), PLAN))
    assert len(s.of(fx.LeaseKey)) == 1 and not s.of(fx.RunHandler) and not s.of(fx.Defer)
    row = s.of(fx.Finish)[0].row
    assert row.status is JobStatus.FAILED and "5000 tokens is more than" in (row.error or "")


def _observing(headers: dict[str, str], error: BaseException | None) -> Callable[[Any], Any]:
    """A handler result that, like ctx.observe(r), hands the response's headers over first."""

    def run(effect: Any) -> fx.HandlerResult:
        effect.tracked.observe(headers)
        return fx.HandlerResult(error=error)

    return run


@pytest.mark.parametrize(
    ("headers", "error", "succeeded", "exhausted"),
    [
        ({"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "2s"}, None, True,
         None),
        ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"},
         RateLimited(2.0), False, True),
        ({}, RateLimited(2.0), False, False),
        ({}, ValueError("boom"), False, None),
    ],
)  # fmt: skip
def test_what_the_key_learns_is_decided_once_for_both_shells(
    headers: dict[str, str], error: BaseException | None, succeeded: bool, exhausted: bool | None
) -> None:
    """A success grows the key back; a 429 the headers explain does not lower it; the headers
    reach the release (sync and async shells drive this same core)."""
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: started(),
               RunHandler=_observing(headers, error), Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), spec(pool="p"), PLAN))
    (release,) = s.of(fx.ReleaseKey)
    assert release.succeeded is succeeded
    said = release.announced
    assert (said.requests if said else None) == (int(v) if (v := headers.get(
        "x-ratelimit-remaining-requests")) else None)  # fmt: skip
    assert [c.exhausted for c in s.of(fx.CoolKey)] == ([] if exhausted is None else [exhausted])


@pytest.mark.parametrize(
    ("result", "counted"),
    [
        (fx.HandlerResult(value=None), (False, False)),
        (fx.HandlerResult(error=RateLimited(2.0)), (True, False)),
        (fx.HandlerResult(error=RuntimeError("500")), (False, True)),
        (fx.HandlerResult(timed_out=True), (False, True)),
        (fx.HandlerResult(error=RuntimeError("x"), cancelled=True), (False, False)),
    ],
)
def test_each_call_with_a_key_is_counted_once_for_both_shells(
    result: fx.HandlerResult, counted: tuple[bool, bool]
) -> None:
    def run(e: fx.RunHandler) -> fx.HandlerResult:
        e.tracked.used(42)
        return result

    s = Script(LeaseKey=lambda e: lease(7), Start=lambda e: started(), RunHandler=run,
               Finish=lambda e: True)  # fmt: skip
    s.run(core.attempt(tracked(), costly(500), PLAN))
    (count,) = s.of(fx.CountUsage)
    assert (count.call.pool, count.call.key_id, count.call.tokens) == ("p", 7, 42)
    assert (count.call.limited, count.call.error) == counted
    order = [type(e) for e in s.seen]
    assert order.index(fx.ReleaseKey) < order.index(fx.CountUsage)


def test_no_call_no_count() -> None:
    s = Script(LeaseKey=lambda e: lease(), Start=lambda e: None)  # a duplicate delivery
    s.run(core.attempt(tracked(), costly(700), PLAN))
    assert s.of(fx.ReleaseKey) and not s.of(fx.CountUsage)


def test_a_write_is_tried_again_at_once_then_after_doubling_pauses_within_its_patience() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    waits = []
    for pause in patience.pauses(4.0, clock):
        waits.append(pause)
        now[0] += pause + 0.01  # the pause, then a try that fails in 10 ms
    assert waits == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # at most 1 s apart
    assert now[0] <= 4.0 + 1.0 and now[0] + 1.0 > 4.0  # no try is left within the 4 s


class _Conn:
    def __init__(self, broken: bool) -> None:
        self.broken = broken


def test_a_write_is_tried_again_only_when_postgres_did_not_answer() -> None:
    # One predicate for both shells: no connection to be had, or the one used broke. A
    # statement's own failure on a working connection (a timeout) is not tried again.
    failed = psycopg.OperationalError("server closed the connection unexpectedly")
    timeout = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    assert patience.unanswered(failed, None)
    assert patience.unanswered(failed, _Conn(broken=True))
    assert not patience.unanswered(timeout, _Conn(broken=False))
    assert not patience.unanswered(psycopg.errors.UniqueViolation("dup"), _Conn(broken=True))
