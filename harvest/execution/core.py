"""The life of one attempt, decided once for sync and async handlers alike.

:func:`attempt` is a generator: it yields :mod:`~harvest.execution.effects` (start this job,
lease a key, run the handler, write this outcome) and receives each effect's result; it never
does I/O itself. A shell drives it: :mod:`~harvest.execution.sync_shell` with blocking calls,
:mod:`~harvest.execution.async_shell` with awaits (the model is psycopg's ``generators.py``
driven by ``waiting.py``). Every decision about a held job lives here or in
:mod:`~harvest.execution.outcome`:

    lost while waiting?  ->  unknown name? (defer, no attempt, for a bounded time)
    ->  gate: rate permit, key lease reserving the job's token cost from the first of its pools
    that can serve (none free: fenced start, then wait up to key_wait, else step back to
    pending with the attempt refunded)
    ->  fenced start, if not begun (a duplicate stops here)  ->  run  ->  decide the outcome
    ->  rest or disable the key  ->  fenced finish  ->  release the key, settling its token
    reservation with what the handler reported (``ctx.used``), and count the call
    (:mod:`harvest.usage`).

A job that must wait for its key starts before it waits, not after: when a key frees, it goes
straight to the call, with no write to Postgres between the lease and the call (measured: the
start write was a third of the time a key spent between two calls under load).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harvest.coordination import fallback
from harvest.coordination.key_pool import IDLE_RETRY, Busy, Lease
from harvest.errors import InvalidCost, UnknownJob
from harvest.execution import away, outcome, sql, tracking
from harvest.execution import effects as fx
from harvest.execution.observe import AttemptEnded, AttemptStarted, Deferred
from harvest.execution.outcome import Outcome
from harvest.execution.tracking import Tracked
from harvest.jobs import Started
from harvest.models import JobStatus
from harvest.usage import Call
from harvest.usage import call as usage_call

if TYPE_CHECKING:
    from harvest.app import JobSpec

DUPLICATES = "duplicate_deliveries_suppressed"
LOST = "lost_outcomes_dropped"
MALFORMED = "malformed_messages_dropped"

KEY_POLL = 0.25  # longest sleep between lease tries while waiting for a key
MIN_WAIT = 0.05  # shortest delay of a deferral

Attempt = Generator[fx.Effect, Any, tuple[str, ...]]
"""Yields effects; returns what became of the job, as counts to add: "started" (and "lost" too
when its outcome was dropped), "suppressed" (a duplicate delivery), "lost" (taken back while it
waited), "deferred", or nothing (cancelled before it started)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What an attempt needs to know about the worker it runs in."""

    worker: str  # hostname:pid
    key_wait: float  # seconds to wait for a key before deferring
    unknown_job_grace: float  # seconds an unknown job name is deferred before it fails
    retry_base: float
    lease_ttl: float  # seconds a job lease and a key lease live without renewal
    known: tuple[str, ...] = ()  # job names this worker can run (for error messages)


@dataclass(frozen=True, slots=True)
class Refused:
    """The gate can never admit this job as it is: the attempt fails with ``error``."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class NotStarted:
    """Its start, made before waiting for a key, did not begin an attempt: ``answer`` is None
    (another delivery started it) or the status it ended in (cancelled before it started)."""

    answer: JobStatus | None


@dataclass(frozen=True, slots=True)
class Wait:
    """The gate is closed for now: try again after ``seconds``."""

    seconds: float
    reason: str


def attempt(
    tracked: Tracked,
    spec: JobSpec | None,
    plan: Plan,
    *,
    deferred_for: float | None = None,
    payload: dict[str, Any] | None = None,
    leased: Lease | None = None,
) -> Attempt:
    """Everything that happens to one held job. ``deferred_for``: how long its current run of
    deferrals has lasted (seconds), from the hold; ``payload``: the job's, for its token cost;
    ``leased``: its key, leased before its hold (``delivery.key_first``): it passed the gate."""
    if tracked.lost:  # taken back (rescued) while it waited its turn
        yield from _dropped(tracked, waiting=True)
        return ("lost",)
    if spec is None and (deferred_for or 0.0) < plan.unknown_job_grace:
        yield from _defer(
            tracked, _growing_wait(deferred_for), _unknown_reason(tracked, plan), plan
        )
        return ("deferred",)
    cost, bad_cost = token_cost(spec, payload)
    if leased is not None:
        passed: Lease | Wait | Refused | NotStarted | None = leased
    else:
        passed = None
        if spec and not bad_cost:
            passed = yield from _gate(spec, tracked, plan, cost, deferred_for)
    if isinstance(passed, NotStarted):
        return (yield from _not_started(passed))
    if isinstance(passed, Refused):
        bad_cost, passed = passed.error, None
    if tracked.handing_back and not isinstance(passed, Wait):
        passed_wait = Wait(0.0, f"handed back: {tracked.handing_back}")
        if passed is not None:
            yield fx.ReleaseKey(passed, used=0)
        passed = passed_wait
    if isinstance(passed, Wait):
        yield from _defer(tracked, passed.seconds, None, plan, why=passed.reason)
        return ("deferred",)
    held = [passed] if passed is not None else []  # emptied once the key is given back
    try:
        return (yield from _started(tracked, spec, held, plan, bad_cost))
    finally:
        if held:
            yield fx.ReleaseKey(held.pop(), used=tracked.settled_tokens())


def token_cost(
    spec: JobSpec | None, payload: dict[str, Any] | None
) -> tuple[int, BaseException | None]:
    """(tokens to reserve, the error of a cost function that failed: the attempt fails with it
    without calling). 0 for a job with no pool or no cost."""
    if spec is None or spec.pool is None:
        return 0, None
    try:
        return spec.cost_of(payload), None
    except InvalidCost as exc:
        return 0, exc


def _gate(
    spec: JobSpec, tracked: Tracked, plan: Plan, cost: int, deferred_for: float | None
) -> Generator[fx.Effect, Any, Lease | Wait | Refused | NotStarted | None]:
    """:func:`gate`; where Redis does not answer, a Wait that grows as :func:`_growing_wait`
    (the job steps back to pending with its attempt refunded, and is dispatched again)."""
    try:
        passed = yield from gate(spec, tracked, plan, cost)
    except away.REDIS_AWAY as exc:
        why = away.failed(exc, "a job's rate permit or key lease")
        return Wait(_growing_wait(deferred_for), why)
    if isinstance(passed, Lease):
        away.answered()
    return passed


def gate(
    spec: JobSpec, tracked: Tracked, plan: Plan, cost: int = 0
) -> Generator[fx.Effect, Any, Lease | Wait | Refused | NotStarted | None]:
    """The job's rate permit, then a key lease with ``cost`` tokens reserved on it within
    ``plan.key_wait`` seconds (None: it needs neither; Refused: a cost above every key's token
    budget in every one of its pools). A pool Redis lost is rebuilt from Postgres once, then
    leased from.

    A job may name several pools (fallback pools): each pass tries them in order and the first
    that leases a key serves; one that cannot (its keys all disabled, cooling or busy) is
    passed over at once. Falling back uses no attempt of its own; and since every pass starts
    from the first pool, jobs go back to it as soon as it can serve again. See
    :func:`_lease_first` for why the tries are separate scripts.

    A job that finds no key free starts its attempt before it waits (:func:`_start`; not its
    last one), so that the key it gets goes straight to its call; if none comes within
    ``key_wait`` it steps back to pending with its attempt refunded (:func:`_defer`)."""
    if spec.rate_limit is not None:
        wait = yield fx.RatePermit(spec)
        if wait:
            return Wait(wait, f"rate limit {spec.rate_limit}")
    pools = fallback.pools(spec.pool)
    if not pools:
        return None
    holder = f"{plan.worker}:{tracked.job_id}"
    deadline = (yield fx.Clock()) + plan.key_wait
    reloaded: set[str] = set()
    while True:
        if tracked.handing_back:
            return Wait(0.0, f"handed back: {tracked.handing_back}")
        sent_at = yield fx.Clock()
        result = yield from _lease_first(pools, holder, cost, reloaded)
        if isinstance(result, Lease):
            tracked.key_renewed(sent_at, plan.lease_ttl)
            return result
        if all(busy.never for busy in result.values()):
            why = f"{cost} tokens is more than any key of {_named(pools)} allows per minute"
            return Refused(InvalidCost(why))
        pool, retry = soonest(result)
        now = yield fx.Clock()
        left = deadline - now
        if left <= 0:
            # Back to pending for no longer than it waited here: ``retry`` is a bound (for keys
            # at their concurrency, the earliest lease *expiry*, 20-30 s away while heartbeats
            # run, where a call ends in about a second), and dispatch sends the job again only
            # when a key can serve it (capacity-aware), so an early return costs nothing.
            delay = max(min(retry, plan.key_wait), MIN_WAIT)
            return Wait(delay, f"no key free in {_named(pools)}")
        if tracked.started is None and tracked.attempt < tracked.max_attempts:
            answer = yield from _start(tracked)  # (a last attempt waits unstarted: see _start)
            if answer is not None:
                return answer
            now = yield fx.Clock()
        left = max(deadline - now, 0.0)
        until = left if len(pools) == 1 else None  # one pool: in line until its time is up
        poll = min(retry, KEY_POLL, KEY_POLL if until is not None else left)
        handed = yield fx.AwaitKey(pool, poll, holder, cost, until)
        if isinstance(handed, Lease):  # a key this process freed, leased for it as it was freed
            tracked.key_renewed(now, plan.lease_ttl)  # (sent after ``now``: fresh for less)
            return handed


def _start(tracked: Tracked) -> Generator[fx.Effect, Any, NotStarted | None]:
    """The fenced start of its attempt (``tracked.started``); NotStarted when none began.

    Before a wait for a key only while attempts remain after this one: a job on its last
    attempt waits unstarted, as rescue fails a running job that has used its attempts, and a
    worker killed during the wait must not fail a job that never called."""
    answer = yield fx.Start(tracked.job_id, tracked.token)
    if not isinstance(answer, Started):
        return NotStarted(answer)
    tracked.started, tracked.attempt = answer, answer.attempt
    return None


def not_started(answer: JobStatus | None) -> Generator[fx.Effect, Any, tuple[str, ...]]:
    """A start that began no attempt: ``answer`` None (a duplicate or stale delivery: another
    one started it, or it was dispatched again) or the status it ended in (cancelled)."""
    return _not_started(NotStarted(answer))


def _not_started(answer: NotStarted) -> Generator[fx.Effect, Any, tuple[str, ...]]:
    if answer.answer is None:  # another delivery of this message started it meanwhile
        yield fx.Bump(DUPLICATES)
        return ("suppressed",)
    return ()  # its cancellation was requested before it started


def _dropped(tracked: Tracked, *, waiting: bool = False) -> Generator[fx.Effect, Any, None]:
    """Its lease was taken back: its outcome is dropped, logged once and counted."""
    tracking.report_lost(tracked, waiting=waiting)
    yield fx.Bump(LOST)


def _lease_first(
    pools: tuple[str, ...], holder: str, cost: int, reloaded: set[str]
) -> Generator[fx.Effect, Any, Lease | dict[str, Busy]]:
    """A lease from the first of ``pools`` (in order) that grants one, or each pool's Busy.

    One lease script per pool, tried in order, rather than one script over all the pools: a
    pool's Redis keys share one hash slot (``{pool}``, see :mod:`harvest.coordination.keys`),
    so a script over several pools could not run on Redis Cluster; and nothing is gained by
    making the pools atomic together, because a job holds one lease: the moment between two
    tries is no different from the moment before the job arrived. Each try stays atomic, and a
    try that grants nothing has no side effect that matters: it takes no lease, no rate permit
    and no token reservation (it only purges entries that had expired anyway, and advances the
    pool's round-robin cursor)."""
    busy: dict[str, Busy] = {}
    for pool in pools:
        result = yield fx.LeaseKey(pool, holder, cost)
        if result is None and pool not in reloaded:
            reloaded.add(pool)
            yield fx.LoadPool(pool)
            result = yield fx.LeaseKey(pool, holder, cost)
        if isinstance(result, Lease):
            return result
        busy[pool] = result if isinstance(result, Busy) else Busy(IDLE_RETRY)
    return busy


def soonest(busy: Mapping[str, Busy]) -> tuple[str, float]:
    """(the pool a key may free first, seconds until then) among pools that could ever serve
    (the earlier pool on a tie): where to wait for a key."""
    waits = [(b.retry_after, i, pool) for i, (pool, b) in enumerate(busy.items()) if not b.never]
    retry, _, pool = min(waits)
    return pool, retry


def _named(pools: tuple[str, ...]) -> str:
    if len(pools) == 1:
        return f"pool {pools[0]!r}"
    return "pools " + ", ".join(repr(p) for p in pools)


def _started(
    tracked: Tracked,
    spec: JobSpec | None,
    held: list[Lease],
    plan: Plan,
    bad_cost: BaseException | None = None,
) -> Generator[fx.Effect, Any, tuple[str, ...]]:
    lease = held[0] if held else None
    if tracked.started is None:
        answer = yield from _start(tracked)
        if answer is not None:
            return (yield from _not_started(answer))
    started = tracked.started
    assert started is not None
    if tracked.lost:  # taken back while it waited for its key: no call
        yield from _dropped(tracked)
        return ("started", "lost")
    tracked.key_lease = lease
    secret = (yield fx.Secret(lease)) if lease is not None else None
    yield fx.Notify(AttemptStarted(started, plan.worker, time.time()))
    if spec is None:  # unknown past its grace: fail it (an attempt is counted)
        result = fx.HandlerResult(error=UnknownJob(started.name, list(plan.known)))
    elif bad_cost is not None:  # its cost function failed: no call (an attempt is counted)
        result = fx.HandlerResult(error=bad_cost)
    elif tracked.cancel.is_set():  # cancelled while it waited for its key: no call
        result = fx.HandlerResult(cancelled=True)
    else:
        tracked.ran = True
        result = yield fx.RunHandler(started, spec, tracked, lease, secret)
    tracked.key_lease = None
    decided = decide(started, spec, result, secret=secret, keyed=lease is not None, plan=plan)
    if lease is not None:
        if decided.key_action is not None:
            with away.tolerated("resting or disabling a key"):
                yield from _key_action(lease, decided, tracked)
        # the key is free for the next job before the write (a release that fails is logged
        # by the shell and the lease expires by itself: it never stops the write)
        yield key_release(held.pop(), tracked, decided)
        if tracked.ran:
            yield fx.CountUsage(usage_of(lease, tracked, decided, started.tenant))
    recorded = False
    if result.ended_elsewhere:
        pass  # ended at its deadline by the watchdog; this late result is dropped
    elif tracked.lost:
        yield from _dropped(tracked)
    else:
        tracked.finishing = True  # before the write: a renewal that misses it now is no news
        recorded = yield fx.Finish(finish_row(started, decided), result.seconds)
        if not recorded:
            yield from _dropped(tracked)
    if not result.ended_elsewhere:
        ended = AttemptEnded(started, decided, result.seconds, plan.worker, recorded, time.time())
        yield fx.Notify(ended)
    return ("started",) if recorded or result.ended_elsewhere else ("started", "lost")


def decide(
    job: Started,
    spec: JobSpec | None,
    result: fx.HandlerResult,
    *,
    secret: str | None,
    keyed: bool,
    plan: Plan,
) -> Outcome:
    """The outcome of what the handler did (pure)."""
    if result.handed_back:
        return outcome.handed_back("the worker shut down before the attempt ended")
    if result.timed_out:
        return outcome.timed_out(job, spec, secret=secret, retry_base=plan.retry_base)
    if result.error is not None:
        if isinstance(result.error, UnknownJob):
            return outcome.unknown_job(result.error, secret)
        return outcome.raised(
            job,
            spec,
            result.error,
            secret=secret,
            cancelled=result.cancelled,
            keyed=keyed,
            retry_base=plan.retry_base,
        )
    return outcome.succeeded(result.value, secret=secret, cancelled=result.cancelled)


def finish_row(job: Started, decided: Outcome) -> sql.Finish:
    """What the attempt's fenced write carries."""
    return sql.Finish(
        job.id,
        job.token,
        decided.status,
        decided.result_json,
        decided.error,
        decided.traceback,
        decided.retry_delay,
        decided.refund_attempt,
    )


def expire(
    tracked: Tracked, job: Started, spec: JobSpec, plan: Plan
) -> Generator[fx.Effect, Any, bool]:
    """End an attempt at its deadline while its handler runs on (a thread that no signal can
    stop): JobTimeout through the retry policy, fenced; the handler's late result is then
    dropped. Returns whether the outcome was recorded."""
    if tracked.finishing or tracked.ended:
        return False
    tracked.ended = True
    decided = outcome.timed_out(job, spec, retry_base=plan.retry_base)
    recorded = bool((yield fx.Finish(finish_row(job, decided))))
    yield fx.Notify(
        AttemptEnded(job, decided, job.timeout or spec.timeout, plan.worker, recorded, time.time())
    )
    return recorded


def hand_back(tracked: Tracked, plan: Plan, reason: str) -> Generator[fx.Effect, Any, bool]:
    """A held job that has not started goes back to pending at once (warm shutdown)."""
    return (yield from _defer(tracked, 0.0, f"handed back: {reason}", plan, why=reason))


def key_release(lease: Lease, tracked: Tracked, decided: Outcome) -> fx.ReleaseKey:
    """Give the key back: settle its tokens with what the handler reported, grow its learned
    limits back when the call succeeded, and pass on what the service announced."""
    succeeded = decided.status == JobStatus.SUCCEEDED
    return fx.ReleaseKey(lease, tracked.settled_tokens(), succeeded, tracked.announced)


def usage_of(lease: Lease, tracked: Tracked, decided: Outcome, tenant: str | None = None) -> Call:
    """What a call made with ``lease`` counts as (pure): a 429 when the handler said the key
    was rate limited, an error when the attempt ended in any other error (not a cancellation,
    nor a hand-back at shutdown)."""
    action = decided.key_action
    limited = action is not None and action.cooldown is not None
    error = decided.error_type not in (None, "HandedBack")
    error = error and decided.status is not JobStatus.CANCELLED
    reported = tracked.tokens_used
    return usage_call(
        lease.pool, lease.key_id, reported=reported, reserved=lease.cost, limited=limited,
        error=error, tenant=tenant or "",
    )  # fmt: skip


def _key_action(
    lease: Lease, decided: Outcome, tracked: Tracked
) -> Generator[fx.Effect, Any, None]:
    action = decided.key_action
    assert action is not None
    if action.cooldown is not None:
        said = tracked.announced
        yield fx.CoolKey(lease, action.cooldown, said is not None and said.exhausted)
    if action.disable:
        yield fx.DisableKey(lease)


def _defer(
    tracked: Tracked, delay: float, reason: str | None, plan: Plan, *, why: str | None = None
) -> Generator[fx.Effect, Any, bool]:
    tracked.finishing = True  # a deferral ends its hold here: as for a finish, see above
    begun = tracked.started is not None
    ok = bool((yield fx.Defer(sql.Defer(tracked.job_id, tracked.token, delay, reason, begun))))
    if ok:
        event = Deferred(
            tracked.job_id, tracked.name, tracked.attempt, delay, why or reason or "", plan.worker
        )
        yield fx.Notify(event)
    return ok


def _growing_wait(deferred_for: float | None) -> float:
    """Deferrals that repeat grow from 1 s to 30 s, a quarter of the time deferred so far (an
    unknown job: a rolling deploy takes minutes; Redis away: restarts take seconds, outages
    minutes), so a long wait costs few rounds and a short one is over soon after it ends."""
    return min(30.0, max(1.0, (deferred_for or 0.0) / 4))


def _unknown_reason(tracked: Tracked, plan: Plan) -> str:
    return (
        f"unknown job {tracked.name!r} on worker {plan.worker}: deferred without using an "
        f"attempt until a worker knows it (at most {plan.unknown_job_grace:g}s)"
    )
