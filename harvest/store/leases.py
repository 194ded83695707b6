"""Writes fenced by a lease: the single-job forms of an attempt's statements (hold, start,
heartbeat, finish, defer), and the rescue of leases that expired."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, TextClause, text

from harvest.execution import sql
from harvest.jobs import Started
from harvest.models import JobStatus

# --- execution (the statements live in harvest.execution.sql; these are single-job forms) ----


def hold(conn: Connection, jobs: Sequence[tuple[int, uuid.UUID]], *, ttl: float) -> dict[int, str]:
    """Extend the dispatch leases of a message's jobs whose token still matches; returns
    {job id: job name} of those held (see :func:`harvest.execution.sql.hold`)."""
    if not jobs:
        return {}
    return {i: h.name for i, h in sql.run(conn, sql.hold(jobs, ttl=ttl)).items()}


def start(
    conn: Connection, job_id: int, token: uuid.UUID, *, ttl: float, worker: str | None = None
) -> Started | JobStatus | None:
    """Dispatched -> running (attempt counted) if the token still matches; ``JobStatus.CANCELLED``
    when cancellation was requested meanwhile; None when the token no longer matches."""
    return sql.run(conn, sql.start([(job_id, token)], ttl=ttl, worker=worker)).get(job_id)


def heartbeat(
    conn: Connection, jobs: Sequence[tuple[int, uuid.UUID]], *, ttl: float
) -> dict[int, bool]:
    """Extend the leases still held; {job id: cancel requested} for those held."""
    return sql.run(conn, sql.heartbeat(jobs, ttl=ttl)) if jobs else {}


def finish(
    conn: Connection,
    job_id: int,
    token: uuid.UUID,
    *,
    status: JobStatus,
    result_json: str | None = None,
    error: str | None = None,
    traceback: str | None = None,
    retry_delay: float = 0.0,
    refund_attempt: bool = False,
) -> bool:
    """The one fenced write that ends an attempt. False: the lease was lost, nothing written."""
    row = sql.Finish(
        job_id, token, status, result_json, error, traceback, retry_delay, refund_attempt
    )
    return job_id in sql.run(conn, sql.finish([row]))


def defer(
    conn: Connection, job_id: int, token: uuid.UUID, *, delay: float, reason: str | None = None
) -> bool:
    """A held job back to pending after ``delay`` without counting an attempt."""
    return job_id in sql.run(conn, sql.defer([sql.Defer(job_id, token, delay, reason)]))


# --- rescue ---------------------------------------------------------------------------------

# Takes back the rows chosen by {chosen}: to pending (or cancelled when asked, or failed when a
# running one has no attempt left), with no lease.
_TAKE_BACK = """
    WITH expired AS (
        SELECT id FROM harvest_jobs
        WHERE {chosen}
        ORDER BY lease_expires_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE harvest_jobs AS j
    SET status = CASE
            WHEN j.cancel_requested THEN 'cancelled'
            WHEN j.status = 'running' AND j.attempts >= j.max_attempts THEN 'failed'
            ELSE 'pending' END,
        last_error = CASE WHEN j.status = 'running'
            THEN 'lease expired: the worker running attempt ' || j.attempts
                 || ' stopped renewing it (killed, paused or cut off)'
            ELSE j.last_error END,
        finished_at = CASE
            WHEN j.cancel_requested OR (j.status = 'running' AND j.attempts >= j.max_attempts)
            THEN now() END,
        lease_token = NULL, lease_expires_at = NULL
    FROM expired WHERE j.id = expired.id
    RETURNING j.id, j.status
    """
_RESCUE = text(
    _TAKE_BACK.format(chosen="status IN ('dispatched', 'running') AND lease_expires_at < now()")
)
# Dispatched jobs whose messages the broker lost: none of them is held yet (a held job is
# running), so each goes back whatever its dispatch lease says; a message of one that a worker
# still holds in memory finds its token gone at its hold, and is suppressed.
_REQUEUE_DISPATCHED = text(_TAKE_BACK.format(chosen="status = 'dispatched'"))


@dataclass(frozen=True, slots=True)
class Rescued:
    requeued: list[int]
    failed: list[int]
    cancelled: list[int]


def rescue_expired(conn: Connection, *, limit: int) -> Rescued:
    """Take back jobs whose lease expired: their worker died, hung or was cut off.

    A re-queued job keeps its ``run_at``: it was due long ago, so it is claimed ahead of the
    backlog that came after it (within its priority), not behind it."""
    return _taken_back(conn, _RESCUE, limit)


def requeue_dispatched(conn: Connection, *, limit: int) -> Rescued:
    """Take back dispatched jobs at once, whatever their dispatch lease: the broker lost their
    messages (:meth:`harvest.broker.Broker.marked_anew`). Each keeps its ``run_at``, as a
    rescued job does."""
    return _taken_back(conn, _REQUEUE_DISPATCHED, limit)


def _taken_back(conn: Connection, statement: TextClause, limit: int) -> Rescued:
    by_status: dict[str, list[int]] = {"pending": [], "failed": [], "cancelled": []}
    for r in conn.execute(statement, {"limit": limit}):
        by_status[r.status].append(r.id)
    return Rescued(by_status["pending"], by_status["failed"], by_status["cancelled"])
