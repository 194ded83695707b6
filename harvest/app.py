"""The Harvest object: the job registry, and enqueue (with backpressure), batches, schedules,
get, wait, cancel and retry."""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ParamSpec, TypeVar, Unpack

import redis
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from harvest import batches, schedules, store, validation
from harvest.backpressure import Admission, DepthGauge, Limit
from harvest.batches import Batch, BatchRef
from harvest.broker import Broker
from harvest.coordination import keys as rkeys
from harvest.db import make_engine, make_sessionmaker, translate_errors
from harvest.errors import (
    BatchNotFound,
    EnqueueError,
    HarvestError,
    InvalidOption,
    JobNotFound,
    QueueFull,
    UnknownJob,
    WaitTimeout,
)
from harvest.jobs import Job, JobRef
from harvest.models import JobStatus
from harvest.retry import RetryPolicy
from harvest.schedules import Schedule, ScheduleChanges
from harvest.settings import Settings

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A registered job: its handler and how it runs."""

    name: str
    func: Callable[..., Any]
    queue: str
    max_attempts: int
    timeout: float
    retry_on: tuple[type[BaseException], ...]
    retry: RetryPolicy
    pool: str | None = None
    rate_limit: str | None = None
    max_depth: int | None = None  # most pending jobs of this name (backpressure)


@dataclass(slots=True)
class _Lazy:
    """Clients made on first use, so that a forked worker child makes its own."""

    engine: Engine | None = None
    sessions: sessionmaker[Session] | None = None
    broker: Broker | None = None
    redis: redis.Redis | None = None
    last_nudge: float = field(default=0.0)
    gauge: DepthGauge = field(default_factory=DepthGauge)


class Harvest:
    """The entry point of the library.

    >>> app = Harvest()            # settings from HARVEST_* environment variables
    >>> @app.job(max_attempts=5)
    ... def fetch(ctx, url): ...
    >>> ref = app.enqueue("fetch", {"url": "https://example.org"})
    >>> app.wait(ref.id, timeout=30).status
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        engine: Engine | None = None,
        broker: Broker | None = None,
        redis_client: redis.Redis | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.jobs: dict[str, JobSpec] = {}
        self._lazy = _Lazy(engine=engine, broker=broker, redis=redis_client)

    # --- registry ---------------------------------------------------------------------------

    def job(
        self,
        name: str | None = None,
        *,
        queue: str = "execution",
        max_attempts: int = 3,
        timeout: float | None = None,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        retry: RetryPolicy | None = None,
        pool: str | None = None,
        rate_limit: str | None = None,
        max_depth: int | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Register ``handler(ctx: JobContext, **payload)`` as a job.

        :param name: the job's name (default: the function's ``module.qualname``).
        :param queue: the Celery queue its messages go to (workers consume it with ``-Q``).
        :param max_attempts: attempts before the job is failed (dead) with its last error.
        :param timeout: seconds an attempt may run (default ``settings.default_timeout``).
        :param retry_on: exceptions that retry; any other exception fails the job at once.
        :param retry: the backoff policy (default: exponential from ``settings.retry_base``).
        :param pool: the API key pool that gates this job (``ctx.key`` inside the handler).
        :param rate_limit: a global rate limit across all workers, e.g. ``"100/m"``.
        :param max_depth: most pending jobs of this name; enqueue beyond it raises
            :class:`~harvest.errors.JobDepthFull` (a QueueFull). The queue's own limit
            (``max_queue_depth``) applies as well.
        """
        validation.check_max_attempts(max_attempts)
        if max_depth is not None and (
            isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1
        ):
            raise InvalidOption("max_depth", f"must be a positive integer, got {max_depth!r}")
        limit = validation.check_timeout(
            timeout if timeout is not None else self.settings.default_timeout,
            maximum=self.settings.max_timeout,
        )
        policy = retry or RetryPolicy(
            base=self.settings.retry_base, max_delay=self.settings.retry_max
        )

        def register(func: Callable[P, R]) -> Callable[P, R]:
            job_name = name or f"{func.__module__}.{func.__qualname__}"
            if job_name in self.jobs and self.jobs[job_name].func is not func:
                raise InvalidOption("name", f"job {job_name!r} is already registered")
            self.jobs[job_name] = JobSpec(
                job_name,
                func,
                queue,
                max_attempts,
                limit,
                tuple(retry_on),
                policy,
                pool,
                rate_limit,
                max_depth,
            )
            return func

        return register

    def load_imports(self, modules: Iterable[str] | None = None) -> None:
        """Import the modules that define jobs (``HARVEST_IMPORTS``) and take the jobs
        registered on every Harvest object found at their top level."""
        for module_name in modules if modules is not None else self.settings.imports:
            module = importlib.import_module(module_name)
            for value in vars(module).values():
                if isinstance(value, Harvest) and value is not self:
                    self.jobs.update(value.jobs)

    def spec(self, name: str) -> JobSpec:
        try:
            return self.jobs[name]
        except KeyError:
            raise UnknownJob(name, list(self.jobs)) from None

    # --- clients ----------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._lazy.engine is None:
            self._lazy.engine = make_engine(self.settings)
        return self._lazy.engine

    @property
    def sessions(self) -> sessionmaker[Session]:
        if self._lazy.sessions is None:
            self._lazy.sessions = make_sessionmaker(self.engine)
        return self._lazy.sessions

    @property
    def broker(self) -> Broker:
        if self._lazy.broker is None:
            self._lazy.broker = Broker(self.settings)
        return self._lazy.broker

    @property
    def redis(self) -> redis.Redis:
        if self._lazy.redis is None:
            self._lazy.redis = redis.Redis.from_url(
                self.settings.redis_url, socket_timeout=5, socket_connect_timeout=5
            )
        return self._lazy.redis

    def after_fork(self) -> None:
        """Forget the parent's connections (call in each forked child before first use)."""
        if self._lazy.engine is not None:
            self._lazy.engine.dispose(close=False)
        self._lazy.redis = None
        self._lazy.broker = None
        self._lazy.gauge = DepthGauge()

    def close(self) -> None:
        if self._lazy.engine is not None:
            self._lazy.engine.dispose()
        if self._lazy.redis is not None:
            self._lazy.redis.close()
        if self._lazy.broker is not None:
            self._lazy.broker.close()
        self._lazy = _Lazy()

    # --- enqueue ----------------------------------------------------------------------------

    def encode_payload(self, spec: JobSpec, payload: Mapping[str, Any]) -> str:
        """``payload`` checked against the job (JSON object, size, handler's parameters) and
        encoded as JSON; raises InvalidPayload / PayloadTooLarge."""
        encoded = validation.encode_payload(payload, limit=self.settings.max_payload_bytes)
        validation.check_signature(spec.func, payload)
        return encoded

    def _new_job(
        self,
        spec: JobSpec,
        payload_json: str,
        *,
        priority: int,
        delay: float | timedelta | None,
        run_at: datetime | None,
        idempotency_key: str | None,
        max_attempts: int | None,
    ) -> store.NewJob:
        seconds = validation.check_delay(delay)
        when = validation.check_run_at(run_at)
        if seconds is not None and when is not None:
            raise InvalidOption("delay", "give delay or run_at, not both")
        return store.NewJob(
            name=spec.name,
            queue=spec.queue,
            payload_json=payload_json,
            priority=validation.check_priority(priority),
            run_at=when,
            delay=seconds,
            max_attempts=validation.check_max_attempts(
                spec.max_attempts if max_attempts is None else max_attempts
            ),
            timeout=spec.timeout,
            idempotency_key=validation.check_idempotency_key(idempotency_key),
            pool=spec.pool,
        )

    def limits(self, spec: JobSpec) -> list[Limit]:
        """The depth limits an enqueue of ``spec`` counts against: its queue's, and its own."""
        found = [Limit(spec.queue, self.settings.queue_depth_limit(spec.queue))]
        if spec.max_depth is not None:
            found.append(Limit(spec.queue, spec.max_depth, job=spec.name))
        return found

    def _admit(
        self, conn: Connection, demands: Mapping[Limit, int]
    ) -> contextlib.AbstractContextManager[Admission]:
        return self._lazy.gauge.admit(conn, demands)

    def _with_room(self, attempt: Callable[[], T], wait: float | None) -> T:
        """Call ``attempt`` until it does not raise QueueFull, for at most ``wait`` seconds."""
        deadline = time.monotonic() + (wait or 0.0)
        pause = 0.05
        while True:
            try:
                return attempt()
            except QueueFull:
                left = deadline - time.monotonic()
                if wait is None or left <= 0:
                    raise
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1.0)

    def enqueue(
        self,
        name: str,
        payload: Mapping[str, Any] | None = None,
        *,
        priority: int = 0,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        wait: float | None = None,
    ) -> JobRef:
        """Store one job; it runs once due. Returns its :class:`JobRef`.

        :param name: a registered job name.
        :param payload: the handler's keyword arguments, a JSON object.
        :param priority: -1000..1000; higher runs first among due jobs.
        :param delay: seconds (or a timedelta) from now before it is due. Any length: the job
            waits in Postgres, never in the broker.
        :param run_at: an aware datetime at which it is due (instead of ``delay``).
        :param idempotency_key: a second enqueue with the same key returns the first job.
        :param max_attempts: overrides the job's default.
        :param wait: when the queue (or the job's ``max_depth``) is full, wait up to this many
            seconds for room instead of raising at once.
        :raises QueueFull: the queue holds its maximum of pending jobs (after ``wait``).
        :raises EnqueueError: (UnknownJob, InvalidPayload, PayloadTooLarge, InvalidOption)
            when refused; nothing is stored then.
        """
        spec = self.spec(name)
        job = self._new_job(
            spec,
            self.encode_payload(spec, payload or {}),
            priority=priority,
            delay=delay,
            run_at=run_at,
            idempotency_key=idempotency_key,
            max_attempts=max_attempts,
        )
        check_wait(wait)
        demands = dict.fromkeys(self.limits(spec), 1)

        def attempt() -> tuple[int, bool]:
            with translate_errors(), self.sessions.begin() as session:
                conn = session.connection()
                if job.idempotency_key is not None:
                    existing = store.find_by_idempotency_key(conn, job.idempotency_key)
                    if existing is not None:
                        return existing, False
                with self._admit(conn, demands) as admission:
                    if not admission.fits(demands):
                        raise admission.refusal(demands)
                    inserted = store.insert_job(session, job)
                    admission.took(demands)
            return inserted

        job_id, created = self._with_room(attempt, wait)
        if created and job.run_at is None and not job.delay:
            self.nudge()
        return JobRef(id=job_id, name=name, created=created)

    def enqueue_many(
        self,
        name: str,
        payloads: Iterable[Mapping[str, Any]],
        *,
        priority: int = 0,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        chunk_size: int = 5000,
        wait: float | None = None,
    ) -> list[int]:
        """Store many jobs of one name in bulk: one statement per ``chunk_size`` rows, all in
        one transaction. Every payload is checked first (one bad item stores nothing).

        Backpressure: as many as fit under the queue's (and the job's) depth limit are stored,
        the first ones of ``payloads``; ``len()`` of the result says how many it took.

        :param wait: when nothing fits, wait up to this many seconds for room.
        :returns: the new jobs' ids, in the order of ``payloads``.
        :raises QueueFull: not one of them fits (after ``wait``); nothing is stored.
        """
        spec = self.spec(name)
        encoded = []
        for i, payload in enumerate(payloads):
            try:
                encoded.append(self.encode_payload(spec, payload))
            except EnqueueError as exc:
                raise exc.at_item(i) from None
        if not encoded:
            return []
        template = self._new_job(
            spec,
            "{}",
            priority=priority,
            delay=delay,
            run_at=run_at,
            idempotency_key=None,
            max_attempts=max_attempts,
        )
        check_wait(wait)
        limits = self.limits(spec)

        def attempt() -> list[int]:
            ids: list[int] = []
            demands = dict.fromkeys(limits, len(encoded))
            with (
                translate_errors(),
                self.engine.begin() as conn,
                self._admit(conn, demands) as admission,
            ):
                take = admission.most(len(encoded))
                if take == 0:
                    raise admission.refusal()
                for start in range(0, take, chunk_size):
                    chunk = encoded[start : min(start + chunk_size, take)]
                    ids.extend(store.insert_many(conn, template, chunk))
                admission.took(dict.fromkeys(limits, take))
            return ids

        ids = self._with_room(attempt, wait)
        if template.run_at is None and not template.delay:
            self.nudge()
        return ids

    def enqueue_batch(
        self,
        jobs: Iterable[tuple[str, Mapping[str, Any]]],
        *,
        on_complete: str | None = None,
        on_complete_payload: Mapping[str, Any] | None = None,
        priority: int = 0,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        wait: float | None = None,
    ) -> BatchRef:
        """Store a batch of jobs (all of them, or none) and, with ``on_complete``, a callback
        job enqueued exactly once when the last member ends (succeeded, failed or cancelled).

        :param jobs: ``(job name, payload)`` pairs; 1 to ``settings.max_batch_size`` of them.
        :param on_complete: a registered job whose handler takes ``batch_id``, ``succeeded``,
            ``failed`` and ``cancelled`` (and ``on_complete_payload``) as keyword arguments.
        :param on_complete_payload: more keyword arguments for the callback.
        :param priority: / :param delay: / :param run_at: / :param max_attempts: for every
            member, as in :meth:`enqueue`.
        :param wait: when the batch does not fit under the depth limits, wait up to this many
            seconds for room.
        :raises QueueFull: the batch does not fit (after ``wait``); nothing is stored.
        """
        members = self._batch_members(
            jobs, priority=priority, delay=delay, run_at=run_at, max_attempts=max_attempts
        )
        new_batch = self._new_batch(len(members), on_complete, on_complete_payload)
        check_wait(wait)
        demands: dict[Limit, int] = {}
        for spec, _ in members:
            for lim in self.limits(spec):
                demands[lim] = demands.get(lim, 0) + 1
        rows = [job for _, job in members]

        def attempt() -> BatchRef:
            with (
                translate_errors(),
                self.engine.begin() as conn,
                self._admit(conn, demands) as admission,
            ):
                if not admission.fits(demands):
                    raise admission.refusal(demands)
                batch_id = store.insert_batch(conn, new_batch)
                ids: list[int] = []
                for start in range(0, len(rows), 5000):
                    ids += store.insert_rows(conn, rows[start : start + 5000], batch_id=batch_id)
                admission.took(demands)
            return BatchRef(id=batch_id, job_ids=ids)

        ref = self._with_room(attempt, wait)
        if rows[0].run_at is None and not rows[0].delay:
            self.nudge()
        return ref

    def _batch_members(
        self,
        jobs: Iterable[tuple[str, Mapping[str, Any]]],
        *,
        priority: int,
        delay: float | timedelta | None,
        run_at: datetime | None,
        max_attempts: int | None,
    ) -> list[tuple[JobSpec, store.NewJob]]:
        members: list[tuple[JobSpec, store.NewJob]] = []
        limit = self.settings.max_batch_size
        for i, item in enumerate(jobs):
            if i >= limit:
                raise InvalidOption("jobs", f"a batch holds at most {limit} jobs (max_batch_size)")
            try:
                if not isinstance(item, tuple | list) or len(item) != 2:
                    raise InvalidOption("jobs", "each item must be a (job name, payload) pair")
                name, payload = item
                spec = self.spec(name)
                job = self._new_job(
                    spec,
                    self.encode_payload(spec, payload),
                    priority=priority,
                    delay=delay,
                    run_at=run_at,
                    idempotency_key=None,
                    max_attempts=max_attempts,
                )
            except EnqueueError as exc:
                raise exc.at_item(i) from None
            members.append((spec, job))
        if not members:
            raise InvalidOption("jobs", "a batch needs at least one job")
        return members

    def _new_batch(
        self, total: int, on_complete: str | None, payload: Mapping[str, Any] | None
    ) -> store.NewBatch:
        if on_complete is None:
            if payload:
                raise InvalidOption("on_complete_payload", "given without on_complete")
            return store.NewBatch(total, None, None, "{}", 0, 1, None, None)
        try:
            spec = self.spec(on_complete)
        except UnknownJob as exc:
            raise InvalidOption("on_complete", str(exc)) from None
        extra = batches.check_callback(spec, payload, limit=self.settings.max_payload_bytes)
        return store.NewBatch(
            total, spec.name, spec.queue, extra, 0, spec.max_attempts, spec.timeout, spec.pool
        )

    def batch(self, batch_id: int) -> Batch:
        """A batch's progress: total, succeeded, failed, cancelled, pending, the callback."""
        with translate_errors(), self.engine.connect() as conn:
            row = store.get_batch(conn, batch_id)
        if row is None:
            raise BatchNotFound(batch_id)
        return Batch.from_row(row)

    def nudge(self) -> None:
        """Ask the dispatcher to look now instead of at its next beat tick. Coalesced through
        Redis: one nudge per ``nudge_coalesce_ms`` across all processes. Best effort: when Redis
        or the broker is down the job is still stored, and beat finds it."""
        now = time.monotonic()
        if now - self._lazy.last_nudge < self.settings.nudge_coalesce_ms / 1000:
            return  # this process nudged (or saw a nudge pending) within the window
        self._lazy.last_nudge = now
        try:
            if self.redis.set(rkeys.nudge(), b"1", nx=True, px=self.settings.nudge_coalesce_ms):
                self.broker.nudge_dispatch()
        except Exception as exc:
            log.warning(
                "dispatch nudge not sent (%s); beat will pick the job up", type(exc).__name__
            )

    # --- reading and cancelling -------------------------------------------------------------

    def get(self, job_id: int) -> Job:
        with translate_errors(), self.engine.connect() as conn:
            job = store.get(conn, job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def wait(self, job_id: int, timeout: float = 60.0, *, poll: float = 0.05) -> Job:
        """Block until the job is succeeded, failed or cancelled; WaitTimeout after ``timeout``."""
        deadline = time.monotonic() + timeout
        interval = poll
        while True:
            with translate_errors(), self.engine.connect() as conn:
                status = store.status_of(conn, job_id)
            if status is None:
                raise JobNotFound(job_id)
            if status.terminal:
                return self.get(job_id)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(job_id, timeout, str(status))
            time.sleep(min(interval, remaining))
            interval = min(interval * 1.5, 1.0)

    def cancel(self, job_id: int) -> JobStatus:
        """Cancel a job: a pending one ends cancelled at once and never runs; a running one is
        asked to stop (``ctx.cancelled``) and ends cancelled. Returns the status now."""
        with translate_errors(), self.engine.begin() as conn:
            status = store.cancel(conn, job_id)
            if status is None:
                current = store.status_of(conn, job_id)
                if current is None:
                    raise JobNotFound(job_id)
                return current
        return status

    def retry(self, job_id: int) -> None:
        """A failed (dead) job back to pending, with one more attempt allowed."""
        with translate_errors(), self.engine.begin() as conn:
            ok = store.retry_failed(conn, job_id)
            if not ok:
                current = store.status_of(conn, job_id)
                if current is None:
                    raise JobNotFound(job_id)
                raise HarvestError(
                    f"job {job_id} is {current}, not failed (only dead jobs can be retried)"
                )
        self.nudge()

    def retry_failed(self, *, name: str | None = None, batch_size: int = 1000) -> int:
        """Every failed (dead) job, or those of one name, back to pending with one more attempt
        allowed, in batches of ``batch_size`` rows. Returns how many."""
        total = 0
        while True:
            with translate_errors(), self.engine.begin() as conn:
                n = len(store.retry_failed_many(conn, name=name, limit=batch_size))
            total += n
            if n < batch_size:
                break
        if total:
            self.nudge()
        return total

    # --- recurring schedules ------------------------------------------------------------------

    def schedule(
        self,
        name: str,
        job: str,
        *,
        cron: str | None = None,
        every: float | timedelta | None = None,
        payload: Mapping[str, Any] | None = None,
        timezone: str = "UTC",
        misfire: str = "run_once",
        catch_up: int = 1,
        priority: int = 0,
        enabled: bool = True,
        start_at: datetime | None = None,
    ) -> Schedule:
        """Get or create the recurring schedule ``name``: ``job`` with ``payload`` at every fire
        time. An existing schedule of that name is returned unchanged (``created`` False): use
        :meth:`update_schedule` to change it.

        :param cron: a cron expression (5 fields, or 6 with seconds last; ``@hourly`` ...),
            evaluated in ``timezone``.
        :param every: instead of ``cron``: seconds (or a timedelta) between fire times, >= 1 s.
        :param payload: the job's keyword arguments, checked against its handler now.
        :param timezone: an IANA name (``Europe/Paris``); cron times follow its DST changes.
        :param misfire: ``skip`` | ``run_once`` | ``catch_up``: what a tick does with fire
            times later than ``HARVEST_SCHEDULE_GRACE`` (see :mod:`harvest.schedules`).
        :param catch_up: with ``misfire="catch_up"``, run at most this many due fire times.
        :param priority: the jobs' priority.
        :param enabled: False creates it paused.
        :param start_at: the first fire time (interval), or the earliest (cron).
        :raises EnqueueError: (UnknownJob, InvalidPayload, InvalidSchedule naming the field)
            when refused; nothing is stored then.
        """
        return schedules.create(
            self, name, job, cron=cron, every=every, payload=payload, timezone=timezone,
            misfire=misfire, catch_up=catch_up, priority=priority, enabled=enabled,
            start_at=start_at,
        )  # fmt: skip

    def update_schedule(self, name: str, **changes: Unpack[ScheduleChanges]) -> Schedule:
        """Change a schedule (None: unchanged): keyword arguments ``job``, ``cron``, ``every``,
        ``payload``, ``timezone``, ``misfire``, ``catch_up``, ``priority`` and ``start_at``, as
        for :meth:`schedule` (see :class:`~harvest.schedules.ScheduleChanges`). A new ``cron``,
        ``every``, ``timezone`` or ``start_at`` re-times it from now. Raises ScheduleNotFound."""
        return schedules.update(self, name, **changes)

    def pause_schedule(self, name: str) -> Schedule:
        """Stop firing ``name`` until resumed."""
        return schedules.set_enabled(self, name, False)

    def resume_schedule(self, name: str) -> Schedule:
        """Fire ``name`` again, from its next fire time after now (the pause is not caught up)."""
        return schedules.set_enabled(self, name, True)

    def delete_schedule(self, name: str) -> None:
        """Delete ``name`` and its fire records (jobs already enqueued stay)."""
        schedules.delete(self, name)

    def get_schedule(self, name: str) -> Schedule:
        return schedules.get(self, name)

    def list_schedules(self) -> list[Schedule]:
        return schedules.list_all(self)


def check_wait(wait: Any) -> float | None:
    """``wait=`` of the enqueue calls: None (do not wait) or seconds >= 0."""
    if wait is None:
        return None
    if (
        isinstance(wait, bool)
        or not isinstance(wait, int | float)
        or not 0 <= wait <= validation.MAX_DELAY
    ):
        raise InvalidOption("wait", f"must be seconds >= 0 (or None), got {wait!r}")
    return float(wait)
