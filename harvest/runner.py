"""Execution of jobs inside a worker: start (fenced), run under a time limit, finish (fenced).

Called by the ``execution`` Celery task with the ids and lease tokens of one message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import Connection

from harvest import store
from harvest.clients import ClientPool
from harvest.context import JobContext
from harvest.coordination.key_pool import Lease
from harvest.errors import JobTimeout, KeyRejected, PermanentError, RateLimited, Retry, UnknownJob
from harvest.gate import Gate, Wait
from harvest.heartbeat import Heartbeat, Tracked
from harvest.jobs import Started
from harvest.models import JobStatus
from harvest.redact import mask_secret, redact_text
from harvest.retry import RetryPolicy, should_retry

if TYPE_CHECKING:
    from harvest.app import Harvest, JobSpec

log = logging.getLogger(__name__)

DUPLICATES = "duplicate_deliveries_suppressed"
LOST = "lost_outcomes_dropped"
MALFORMED = "malformed_messages_dropped"
GRACE = 5.0  # seconds past a job's time limit before its lease stops being renewed


@dataclass(frozen=True, slots=True)
class Outcome:
    status: JobStatus
    result_json: str | None = None
    error: str | None = None
    traceback: str | None = None
    retry_delay: float = 0.0
    refund_attempt: bool = False


def parse_message(body: Any) -> list[tuple[int, uuid.UUID]]:
    """``[[job_id, token], ...]`` -> typed pairs. Anything else is refused as a whole."""
    if not isinstance(body, list) or not body:
        raise ValueError("execution message must be a non-empty list of [job_id, token]")
    pairs = []
    for item in body:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or isinstance(item[0], bool)
            or not isinstance(item[0], int)
            or not isinstance(item[1], str)
        ):
            raise ValueError("execution message items must be [job_id, token]")
        pairs.append((item[0], uuid.UUID(item[1])))
    return pairs


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise JobTimeout in the handler after ``seconds`` (SIGALRM; main thread only. Elsewhere
    the lease stops being renewed at the deadline, and rescue takes the job back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _expired(signum: int, frame: FrameType | None) -> None:
        raise JobTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _http_client(secret: str) -> httpx.Client:
    return httpx.Client(headers={"Authorization": f"Bearer {secret}"}, timeout=30.0)


def _scrub(text: str, secret: str | None) -> str:
    """Redact URL passwords, and the leased key wherever a handler let it into a message."""
    text = redact_text(text)
    return text.replace(secret, mask_secret(secret)) if secret else text


class Runner:
    def __init__(self, app: Harvest) -> None:
        self.app = app
        settings = app.settings
        self.gate = Gate(app)
        self._conn: Connection | None = None
        self.clients: ClientPool[httpx.Client] = ClientPool(
            _http_client, healthy=lambda client: not client.is_closed
        )
        self.heartbeat = Heartbeat(
            app.engine,
            ttl=settings.lease_ttl,
            interval=settings.heartbeat_interval,
            renew_key=self.gate.heartbeat,
        )

    def execute(self, body: Any) -> dict[str, int]:
        """Run the jobs of one message, one after the other. Returns counts."""
        try:
            pairs = parse_message(body)
        except (ValueError, TypeError) as exc:
            log.error("dropped a malformed execution message: %s", exc)
            self._bump(MALFORMED)
            return {"started": 0, "suppressed": 0, "lost": 0, "deferred": 0}
        with self.app.engine.connect() as conn:
            # Autocommit: hold, start and finish are each one fenced statement, atomic on its
            # own; a transaction around each would add a BEGIN and a COMMIT round trip apiece.
            conn.execution_options(isolation_level="AUTOCOMMIT")
            self._conn = conn
            try:
                return self._execute(pairs)
            finally:
                self._conn = None

    def _execute(self, pairs: list[tuple[int, uuid.UUID]]) -> dict[str, int]:
        with self._tx() as conn:
            held = store.hold(conn, pairs, ttl=self.app.settings.lease_ttl)
            suppressed = len(pairs) - len(held)
            store.bump(conn, DUPLICATES, suppressed)
        if suppressed:
            log.info("suppressed %d duplicate or stale deliveries", suppressed)
        mine = [(job_id, token) for job_id, token in pairs if job_id in held]
        tracked = {job_id: self._track(job_id, token) for job_id, token in mine}
        counts = {"started": 0, "suppressed": suppressed, "lost": 0, "deferred": 0}
        try:
            for job_id, token in mine:
                self._one(job_id, token, held[job_id], tracked[job_id], counts)
        finally:
            for job_id, _ in mine:
                self.heartbeat.untrack(job_id)
        if mine:
            self.app.nudge()
        return counts

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Connection]:
        """This message's connection (one pool checkout per message, not one per statement;
        autocommit, so each statement commits by itself: the counters bumped beside a fenced
        write are statistics and need not share its commit), or a fresh transaction outside
        a message."""
        if self._conn is None:
            with self.app.engine.begin() as conn:
                yield conn
            return
        with self._conn.begin():
            yield self._conn

    def _one(
        self, job_id: int, token: uuid.UUID, name: str, tracked: Tracked, counts: dict[str, int]
    ) -> None:
        """Gate, start, run and finish one held job, counting what happened to it."""
        if tracked.lost:  # taken back (rescued) while it waited its turn
            self._bump(LOST)
            counts["lost"] += 1
            return
        spec = self.app.jobs.get(name)
        passed = self._pass_gate(spec, job_id)
        if isinstance(passed, Wait):
            with self._tx() as conn:
                store.defer(conn, job_id, token, delay=passed.seconds)
            log.info("job %s deferred %.2fs: %s", job_id, passed.seconds, passed.reason)
            counts["deferred"] += 1
            return
        try:
            with self._tx() as conn:
                job = store.start(conn, job_id, token, ttl=self.app.settings.lease_ttl)
                if job is None:  # another delivery of this message started it meanwhile
                    store.bump(conn, DUPLICATES)
            if job is None:
                counts["suppressed"] += 1
            if not isinstance(job, Started):
                return
            counts["started"] += 1
            tracked.key_lease = passed
            counts["lost"] += not self._run_and_finish(job, tracked)
        finally:
            tracked.key_lease = None
            if passed is not None:
                self.gate.release(passed)

    def _pass_gate(self, spec: JobSpec | None, job_id: int) -> Lease | Wait | None:
        """The job's rate permit and key lease (None: it needs neither)."""
        if spec is None:
            return None
        wait = self.gate.rate_permit(spec)
        if wait is not None or spec.pool is None:
            return wait
        return self.gate.lease(spec.pool, job_id)

    def _track(self, job_id: int, token: uuid.UUID) -> Tracked:
        tracked = Tracked(job_id, token, float("inf"), threading.Event())
        self.heartbeat.track(tracked)
        return tracked

    def _run_and_finish(self, job: Started, tracked: Tracked) -> bool:
        timeout = job.timeout or self.app.settings.default_timeout
        tracked.deadline = time.monotonic() + timeout + GRACE
        lease = tracked.key_lease
        ctx = JobContext(
            job_id=job.id,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            name=job.name,
            lease=lease,
            clients=self.clients,
            _lease_check=(lambda: not tracked.lost and self.gate.heartbeat(lease))
            if lease is not None
            else None,
            _cancel=tracked.cancel,
        )
        outcome = self._run(job, ctx)
        if tracked.lost:
            ok = False
            self._bump(LOST)
        else:
            with self._tx() as conn:
                ok = store.finish(
                    conn,
                    job.id,
                    job.token,
                    status=outcome.status,
                    result_json=outcome.result_json,
                    error=outcome.error,
                    traceback=outcome.traceback,
                    retry_delay=outcome.retry_delay,
                    refund_attempt=outcome.refund_attempt,
                )
                if not ok:
                    store.bump(conn, LOST)
        if not ok:
            log.warning(
                "job %s attempt %s: lease lost; outcome %s dropped (a newer attempt owns it)",
                job.id,
                job.attempt,
                outcome.status,
            )
        return ok

    def _run(self, job: Started, ctx: JobContext) -> Outcome:
        spec: JobSpec | None = self.app.jobs.get(job.name)
        if ctx.cancelled:
            return Outcome(JobStatus.CANCELLED, error="cancelled before it started")
        try:
            if spec is None:
                raise UnknownJob(job.name, list(self.app.jobs))
            if ctx.lease is not None:
                ctx.key = self.gate.secret(ctx.lease)
            with time_limit(spec.timeout):
                result = spec.func(ctx, **job.payload)
            result_json = json.dumps(result, allow_nan=False) if result is not None else None
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return self._failure(job, ctx, spec, exc)
        if ctx.cancelled:
            return Outcome(JobStatus.CANCELLED, result_json=result_json, error="cancelled")
        return Outcome(JobStatus.SUCCEEDED, result_json=result_json)

    def _failure(
        self, job: Started, ctx: JobContext, spec: JobSpec | None, exc: BaseException
    ) -> Outcome:
        error = _scrub(f"{type(exc).__name__}: {exc}", ctx.key)[:4000]
        tb = _scrub("".join(traceback.format_exception(exc)), ctx.key)[-20000:]
        if ctx.cancelled:
            return Outcome(JobStatus.CANCELLED, error=error, traceback=tb)
        if ctx.lease is not None and isinstance(exc, RateLimited | KeyRejected):
            # The key's fault, not the job's: rest or disable the key, retry on another one.
            if isinstance(exc, RateLimited):
                self.gate.rate_limited(ctx.lease, exc.retry_after)
                delay = exc.retry_after
            else:
                self.gate.rejected(ctx.lease)
                delay = 0.0
            return Outcome(
                JobStatus.PENDING, error=error, traceback=tb, retry_delay=delay, refund_attempt=True
            )
        retryable = (
            spec is None
            or (isinstance(exc, spec.retry_on) and not isinstance(exc, PermanentError | TypeError))
            or isinstance(exc, Retry)
        )
        if retryable and should_retry(job.attempt, job.max_attempts):
            if isinstance(exc, Retry) and exc.delay is not None:
                delay = exc.delay
            else:
                policy = spec.retry if spec else RetryPolicy(base=self.app.settings.retry_base)
                delay = policy.delay(job.attempt)
            return Outcome(JobStatus.PENDING, error=error, traceback=tb, retry_delay=delay)
        return Outcome(JobStatus.FAILED, error=error, traceback=tb)

    def _bump(self, name: str) -> None:
        with self._tx() as conn:
            store.bump(conn, name)
