"""Immutable values that cross boundaries: jobs as callers see them, never ORM objects."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from harvest.errors import InvalidJobId, JobNotFound
from harvest.models import JobStatus

BIGINT_MAX = 2**63 - 1  # a job id is a Postgres bigint: no job has an id beyond its range


@dataclass(frozen=True, slots=True)
class JobRef:
    """What enqueue returns: the job's id, and whether this call created it (False when an
    idempotency key matched an existing job)."""

    id: int
    name: str
    created: bool = True


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    name: str
    queue: str
    payload: dict[str, Any] | None  # None only when unreadable (see below)
    status: JobStatus
    priority: int
    run_at: datetime | None  # None only when unreadable
    attempts: int
    max_attempts: int
    idempotency_key: str | None
    result: Any
    last_error: str | None
    last_traceback: str | None
    cancel_requested: bool
    created_at: datetime | None  # None only when unreadable
    dispatched_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    lease_expires_at: datetime | None
    worker: str | None = None  # hostname:pid of the process that ran (or runs) the last attempt
    tenant: str | None = None  # fairness key (enqueue's ``tenant=``); None: no tenant
    # Values of the row Python cannot hold (written around enqueue's checks: a time outside
    # years 1 to 9999, a number JSON readers refuse), each with why; they read as None.
    unreadable: tuple[str, ...] = ()

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Job:
        values = {name: row[name] for name in cls.__dataclass_fields__ if name in row}
        values["status"] = JobStatus(row["status"])
        return cls(**values)

    @property
    def terminal(self) -> bool:
        return self.status.terminal


def job_id_of(job: int | JobRef | Job) -> int:
    """The id of the job ``job`` names: its id, the JobRef enqueue returned, or a Job. Anything
    else (a str, a bool, a float) is refused with :class:`~harvest.errors.InvalidJobId`, and
    an int no bigint can hold with :class:`~harvest.errors.JobNotFound`, before any query."""
    if isinstance(job, (JobRef, Job)):
        return job.id
    if not isinstance(job, int) or isinstance(job, bool):
        raise InvalidJobId(job)
    if not -BIGINT_MAX - 1 <= job <= BIGINT_MAX:
        raise JobNotFound(job)
    return job


@dataclass(frozen=True, slots=True)
class Claimed:
    """A job the dispatcher has claimed: what one execution message carries per job."""

    id: int
    token: uuid.UUID
    queue: str
    name: str = ""


@dataclass(frozen=True, slots=True)
class Started:
    """A job an execution worker has started: its lease is live and fenced by ``token``."""

    id: int
    token: uuid.UUID
    name: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    timeout: float | None
    cancel_requested: bool
    tenant: str | None = None  # its fairness key (``enqueue(..., tenant=)``), counted in usage
