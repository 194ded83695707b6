"""Statements that end, revive or remove jobs by hand or by age: cancel, retry and delete of
dead jobs, retention, and emptying the tables between users' tests (harvest.testing)."""

from __future__ import annotations

from sqlalchemy import Connection, TextClause, text

from harvest.models import JobStatus
from harvest.store import history_rows

_CANCEL = text(
    """
    UPDATE harvest_jobs
    SET status = CASE WHEN status = 'pending' THEN 'cancelled' ELSE status END,
        finished_at = CASE WHEN status = 'pending' THEN now() ELSE finished_at END,
        cancel_requested = status IN ('pending', 'dispatched', 'running')
    WHERE id = :id AND status NOT IN ('succeeded', 'failed', 'cancelled')
    RETURNING status
    """
)


def cancel(conn: Connection, job_id: int) -> JobStatus | None:
    """Pending -> cancelled at once; dispatched or running -> cancel requested (the worker
    stops it). Returns the status after the call, or None if the job was already terminal."""
    value = conn.execute(_CANCEL, {"id": job_id}).scalar_one_or_none()
    return JobStatus(value) if value is not None else None


_RETRY_FAILED = text(
    """
    UPDATE harvest_jobs
    SET status = 'pending', run_at = now(), finished_at = NULL,
        max_attempts = greatest(max_attempts, attempts + 1)
    WHERE id = ANY(:ids) AND status = 'failed'
    RETURNING id
    """
)


def _retry(conn: Connection, ids: list[int]) -> list[int]:
    return [int(i) for i in conn.execute(_RETRY_FAILED, {"ids": ids}).scalars()]


def retry_failed(conn: Connection, job_id: int) -> bool:
    """A dead job back to pending with one more attempt allowed; its last error is kept. A job
    already moved to the history (:mod:`harvest.store.history_rows`) moves back first."""
    if _retry(conn, [job_id]):
        return True
    revived = history_rows.revive_dead(conn, ids=[job_id], limit=1)
    return bool(revived and _retry(conn, revived))


_RETRY_FAILED_MANY = text(
    """
    WITH chosen AS (
        SELECT id FROM harvest_jobs
        WHERE status = 'failed' AND (CAST(:name AS text) IS NULL OR name = CAST(:name AS text))
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE harvest_jobs AS j
    SET status = 'pending', run_at = now(), finished_at = NULL,
        max_attempts = greatest(j.max_attempts, j.attempts + 1)
    FROM chosen WHERE j.id = chosen.id
    RETURNING j.id
    """
)


def retry_failed_many(conn: Connection, *, name: str | None = None, limit: int = 1000) -> list[int]:
    """Up to ``limit`` dead jobs (of one name, or all) back to pending: those in the jobs
    table first, then those in the history (moved back, then retried)."""
    rows = conn.execute(_RETRY_FAILED_MANY, {"name": name, "limit": limit})
    done = [int(i) for i in rows.scalars()]
    if len(done) < limit:
        revived = history_rows.revive_dead(conn, name=name, limit=limit - len(done))
        if revived:
            done += _retry(conn, revived)
    return done


_DELETE_DEAD = text("DELETE FROM harvest_jobs WHERE id = :id AND status = 'failed'")

_DELETE_DEAD_MANY = text(
    """
    DELETE FROM harvest_jobs WHERE id IN (
        SELECT id FROM harvest_jobs
        WHERE status = 'failed' AND (CAST(:name AS text) IS NULL OR name = CAST(:name AS text))
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)


def delete_failed(conn: Connection, job_id: int) -> bool:
    """Delete one dead (failed) job, in the jobs table or the history. False when it is not
    failed (or gone)."""
    if conn.execute(_DELETE_DEAD, {"id": job_id}).rowcount == 1:
        return True
    return history_rows.delete_dead(conn, ids=[job_id], limit=1) == 1


def delete_failed_many(conn: Connection, *, name: str | None, limit: int) -> int:
    """Delete up to ``limit`` dead jobs (of one name, or all), skipping locked rows: those in
    the jobs table first, then those in the history."""
    n = int(conn.execute(_DELETE_DEAD_MANY, {"name": name, "limit": limit}).rowcount)
    if n < limit:
        n += history_rows.delete_dead(conn, name=name, limit=limit - n)
    return n


# --- retention ----------------------------------------------------------------------------------


def _prune_jobs_statement(statuses: str) -> TextClause:
    # Literal statuses so the planner proves the partial index harvest_jobs_finished_idx.
    return text(
        f"""
        DELETE FROM harvest_jobs WHERE id IN (
            SELECT id FROM harvest_jobs
            WHERE status IN {statuses}
              AND finished_at < now() - make_interval(secs => :age)
            ORDER BY finished_at
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        )
        """
    )


_PRUNE_FINISHED = _prune_jobs_statement("('succeeded', 'cancelled')")
_PRUNE_DEAD = _prune_jobs_statement("('failed')")

_PRUNE_FIRES = text(
    """
    DELETE FROM harvest_schedule_fires WHERE (schedule_id, fire_at) IN (
        SELECT schedule_id, fire_at FROM harvest_schedule_fires
        WHERE fire_at < now() - make_interval(secs => :age)
        ORDER BY fire_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)

_PRUNE_BATCHES = text(
    """
    DELETE FROM harvest_batches WHERE id IN (
        SELECT id FROM harvest_batches
        WHERE completed_at < now() - make_interval(secs => :age)
        ORDER BY completed_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)

_PRUNES = {
    "finished": _PRUNE_FINISHED,
    "dead": _PRUNE_DEAD,
    "fires": _PRUNE_FIRES,
    "batches": _PRUNE_BATCHES,
}


def prune(conn: Connection, what: str, *, older_than: float, limit: int) -> int:
    """Delete up to ``limit`` rows of one kind that ended more than ``older_than`` seconds ago
    (``finished``: succeeded and cancelled jobs; ``dead``: failed jobs; ``fires``: schedule fire
    records; ``batches``: completed batches). Rows locked by anyone are skipped, and only
    terminal jobs are touched, so this never waits on (or blocks) the claim path."""
    result = conn.execute(_PRUNES[what], {"age": older_than, "limit": limit})
    return int(result.rowcount)


# --- harvest.testing: users' own tests --------------------------------------------------------

_MAKE_DUE = text(
    """
    UPDATE harvest_jobs SET run_at = now()
    WHERE status = 'pending' AND run_at > now() AND (attempts > 0 OR CAST(:delayed AS boolean))
    """
)
_HARVEST_TABLES = text(
    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
    "AND tablename LIKE 'harvest\\_%' AND tablename <> 'harvest_alembic_version'"
)


def make_due(conn: Connection, *, delayed: bool) -> int:
    """Pending jobs waiting for a retry (and, with ``delayed``, for their delay) due now."""
    return int(conn.execute(_MAKE_DUE, {"delayed": delayed}).rowcount)


def empty_tables(conn: Connection) -> None:
    """Every harvest table emptied, ids restarted (the schema stays): between users' tests."""
    tables = list(conn.execute(_HARVEST_TABLES).scalars())
    if tables:
        conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
