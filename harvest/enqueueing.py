"""Enqueue: one job, many of one name, or a batch, each checked at the door (payload,
options) and admitted under the depth limits (backpressure) before it is stored; then the
dispatcher is nudged. :class:`Enqueueing` is a part of the :class:`~harvest.app.Harvest`
facade: its methods are the facade's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from harvest import batches, store, validation
from harvest.backpressure import Admission, Limit
from harvest.batches import BatchRef
from harvest.db import autocommit_driver, translate_errors
from harvest.errors import EnqueueError, InvalidOption, QueueFull, UnknownJob
from harvest.jobs import JobRef

if TYPE_CHECKING:
    from harvest.app import JobSpec, _Lazy
    from harvest.settings import Settings
    from harvest.transactional import CallerConnection

T = TypeVar("T")


class Enqueueing:
    """enqueue, enqueue_many and enqueue_batch, with their checks and admission."""

    if TYPE_CHECKING:  # what the facade provides
        settings: Settings
        _lazy: _Lazy

        @property
        def engine(self) -> Engine: ...
        @property
        def sessions(self) -> sessionmaker[Session]: ...
        def spec(self, name: str) -> JobSpec: ...
        def nudge(self) -> None: ...

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
        tenant: str | None = None,
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
            tenant=validation.check_tenant(tenant),
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
        connection: CallerConnection | None = None,
        tenant: str | None = None,
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
        :param connection: write the job in this transaction (a SQLAlchemy ``Connection`` or
            ``Session``, or a psycopg connection): it exists if and only if the caller commits
            (see :mod:`harvest.transactional`).
        :param tenant: the job's fairness key (text, as a queue name): dispatch shares each
            claim round-robin (by ``settings.tenant_weights``) across the tenants with due
            jobs, so one tenant's backlog cannot hold back another's jobs. None: the jobs
            without a tenant, which share as one tenant of their own.
        :raises QueueFull: the queue holds its maximum of pending jobs (after ``wait``).
        :raises EnqueueError: (UnknownJob, InvalidPayload, PayloadTooLarge, InvalidOption)
            when refused; nothing is stored then.
        """
        spec = self.spec(name)
        job = self._new_job(
            spec,
            self.encode_payload(spec, {} if payload is None else payload),
            priority=priority,
            delay=delay,
            run_at=run_at,
            idempotency_key=idempotency_key,
            max_attempts=max_attempts,
            tenant=tenant,
        )
        check_wait(wait)
        demands = dict.fromkeys(self.limits(spec), 1)
        job_id, created = self._with_room(lambda: self._insert(job, demands, connection), wait)
        if created and job.run_at is None and not job.delay:
            self._nudge_after(connection)
        return JobRef(id=job_id, name=name, created=created)

    def _insert(
        self, job: store.NewJob, demands: dict[Limit, int], connection: CallerConnection | None
    ) -> tuple[int, bool]:
        """Store ``job`` if it fits under the depth limits (QueueFull if not): its id and True,
        or the id of the job stored before with its idempotency key and False.

        The common case, a job of harvest's own transaction without an idempotency key whose
        limits are far from full, is one statement in one round trip (its locks and its row,
        :func:`harvest.store.insert_admitted`); the rest is a transaction of several."""
        if connection is None and job.idempotency_key is None:
            with self._lazy.gauge.trusted(demands) as keys:
                if keys is not None:
                    with translate_errors(), autocommit_driver(self.engine) as conn:
                        return store.insert_admitted(conn, job, keys), True
        with translate_errors(), self._transaction(connection) as session:
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
        connection: CallerConnection | None = None,
        tenant: str | None = None,
    ) -> list[int]:
        """Store many jobs of one name in bulk: one statement per ``chunk_size`` rows, all in
        one transaction. Every payload is checked first (one bad item stores nothing).

        Backpressure: as many as fit under the queue's (and the job's) depth limit are stored,
        the first ones of ``payloads``; ``len()`` of the result says how many it took.

        :param wait: when nothing fits, wait up to this many seconds for room.
        :param connection: write the jobs in the caller's transaction, as for :meth:`enqueue`.
        :param tenant: every job's fairness key, as for :meth:`enqueue`.
        :returns: the new jobs' ids, in the order of ``payloads``.
        :raises QueueFull: not one of them fits (after ``wait``); nothing is stored.
        """
        spec = self.spec(name)
        encoded = self._encode_each(spec, payloads)
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
            tenant=tenant,
        )
        check_wait(wait)
        limits = self.limits(spec)
        ids = self._with_room(
            lambda: self._insert_many(template, encoded, limits, chunk_size, connection), wait
        )
        if template.run_at is None and not template.delay:
            self._nudge_after(connection)
        return ids

    def _encode_each(self, spec: JobSpec, payloads: Iterable[Mapping[str, Any]]) -> list[str]:
        """Every payload checked and encoded; the first refused one raises, naming its item."""
        encoded = []
        for i, payload in enumerate(payloads):
            try:
                encoded.append(self.encode_payload(spec, payload))
            except EnqueueError as exc:
                raise exc.at_item(i) from None
        return encoded

    def _insert_many(
        self,
        template: store.NewJob,
        encoded: list[str],
        limits: list[Limit],
        chunk_size: int,
        connection: CallerConnection | None,
    ) -> list[int]:
        """Store the first of ``encoded`` that fit under ``limits`` (QueueFull when none does),
        ``chunk_size`` rows a statement; their ids."""
        ids: list[int] = []
        demands = dict.fromkeys(limits, len(encoded))
        with (
            translate_errors(),
            self._transaction(connection) as session,
            self._admit(conn := session.connection(), demands) as admission,
        ):
            take = admission.most(len(encoded))
            if take == 0:
                raise admission.refusal()
            for start in range(0, take, chunk_size):
                chunk = encoded[start : min(start + chunk_size, take)]
                ids.extend(store.insert_many(conn, template, chunk))
            admission.took(dict.fromkeys(limits, take))
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
        tenant: str | None = None,
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
        :param tenant: every member's fairness key, as in :meth:`enqueue` (not the callback's).
        :raises QueueFull: the batch does not fit (after ``wait``); nothing is stored.
        """
        members = self._batch_members(
            jobs, tenant, priority=priority, delay=delay, run_at=run_at, max_attempts=max_attempts
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
        tenant: str | None,
        *,
        priority: int,
        delay: float | timedelta | None,
        run_at: datetime | None,
        max_attempts: int | None,
    ) -> list[tuple[JobSpec, store.NewJob]]:
        tenant = validation.check_tenant(tenant)  # the batch's own option: not an item's
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
                    tenant=tenant,
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

    def _transaction(
        self, connection: CallerConnection | None
    ) -> contextlib.AbstractContextManager[Session]:
        """A new transaction of harvest's own, or a SAVEPOINT in the caller's."""
        if connection is None:
            return self.sessions.begin()
        from harvest import transactional

        return transactional.joined(self.engine, connection)

    def _nudge_after(self, connection: CallerConnection | None) -> None:
        """Nudge now, or once the caller's transaction commits."""
        if connection is None:
            self.nudge()
            return
        from harvest import transactional

        transactional.after_commit(connection, self.nudge)


def check_wait(wait: Any) -> float | None:
    """``wait=`` of the enqueue calls: None (do not wait) or seconds >= 0."""
    if wait is None:
        return None
    if (
        isinstance(wait, bool)
        or not isinstance(wait, int | float)
        or not 0 <= wait <= validation.MAX_DELAY
    ):
        raise InvalidOption("wait", f"must be seconds >= 0 (or None), got {validation.shown(wait)}")
    return float(wait)
