"""The attempts a job made: one row per ended attempt (start, end, worker, outcome, error),
recorded by Postgres itself when the job leaves ``running`` (migration 0007), the last 20 per
job, deleted with the job. When the job moves to the partitioned history (migration 0013) its
attempts go with it, as the history row's ``attempt_log``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text

KEPT = 20  # attempts kept per job (the trigger's KEEP)


@dataclass(frozen=True, slots=True)
class Attempt:
    attempt: int
    worker: str | None
    started_at: datetime | None
    ended_at: datetime
    outcome: str  # succeeded, retry, failed, cancelled
    error: str | None

    @property
    def seconds(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


_ATTEMPTS = text(
    """
    SELECT attempt, worker, started_at, ended_at, outcome, error FROM (
        SELECT attempt, worker, started_at, ended_at, outcome, error, id AS n
        FROM harvest_job_attempts WHERE job_id = :id
        UNION ALL
        SELECT a.attempt, a.worker, a.started_at, a.ended_at, a.outcome, a.error, a.n
        FROM harvest_job_history AS h CROSS JOIN LATERAL ROWS FROM (
            jsonb_to_recordset(h.attempt_log) AS (attempt integer, worker text,
                started_at timestamptz, ended_at timestamptz, outcome text, error text)
        ) WITH ORDINALITY AS a(attempt, worker, started_at, ended_at, outcome, error, n)
        WHERE h.id = :id
    ) AS recorded
    ORDER BY ended_at, n
    """
)


def attempts(conn: Connection, job_id: int) -> list[Attempt]:
    """The job's recorded attempts, oldest first (at most :data:`KEPT`): from
    ``harvest_job_attempts``, or, once the job moved to the history, from its ``attempt_log``."""
    return [Attempt(*row) for row in conn.execute(_ATTEMPTS, {"id": job_id})]
