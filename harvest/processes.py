"""The live execution processes and the jobs each runs now (what Sidekiq's Busy page and Oban
Web's Processes view show): the worker registry in Redis (who is up, with what capacity),
joined with Postgres for the names and start times of the jobs they list."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from redis import Redis
from sqlalchemy import Engine, text

from harvest.execution.registry import WorkerInfo, live


@dataclass(frozen=True, slots=True)
class RunningJob:
    id: int
    name: str
    status: str  # dispatched (held, waiting at the gate) or running
    started_at: datetime | None


@dataclass(frozen=True, slots=True)
class Process:
    info: WorkerInfo
    jobs: list[RunningJob]

    @property
    def seen_ago(self) -> float:
        return max(0.0, time.time() - self.info.last_seen)


def processes(engine: Engine, redis: Redis) -> list[Process]:
    """Every live execution process, oldest first, with the jobs it holds now (running first,
    then those held and waiting for a key, each by id)."""
    workers = live(redis)
    ids = sorted({job_id for w in workers for job_id in w.running})
    found: dict[int, RunningJob] = {}
    if ids:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, name, status, started_at FROM harvest_jobs "
                    "WHERE id = ANY(:ids) AND status IN ('dispatched', 'running')"
                ),
                {"ids": ids},
            ).all()
        found = {row.id: RunningJob(row.id, row.name, row.status, row.started_at) for row in rows}
    return [
        Process(
            w,
            sorted(
                (found[i] for i in w.running if i in found),
                key=lambda j: (j.status != "running", j.id),
            ),
        )
        for w in workers
    ]
