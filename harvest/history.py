"""The attempts a job made: one row per ended attempt (start, end, worker, outcome, error),
recorded by Postgres itself when the job leaves ``running`` (migration 0007), the last 20 per
job, deleted with the job."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select

from harvest.models import AttemptRow

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


def attempts(conn: Connection, job_id: int) -> list[Attempt]:
    """The job's recorded attempts, oldest first (at most :data:`KEPT`)."""
    rows = conn.execute(
        select(
            AttemptRow.attempt,
            AttemptRow.worker,
            AttemptRow.started_at,
            AttemptRow.ended_at,
            AttemptRow.outcome,
            AttemptRow.error,
        )
        .where(AttemptRow.job_id == job_id)
        .order_by(AttemptRow.ended_at, AttemptRow.id)
    ).all()
    return [Attempt(*row) for row in rows]
