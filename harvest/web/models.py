"""The JSON API's request and response models (pydantic): what ``/api`` sends and takes,
as its OpenAPI document describes it. Built from harvest's own values (``Job``, ``Schedule``,
``Batch``, the dashboard's pool views), never from ORM rows."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from harvest.batches import Batch
from harvest.jobs import Job
from harvest.schedules import Schedule
from harvest.web import data, filters
from harvest.web.filters import MAX_COUNT, NAME_MAX

Status = Literal["pending", "dispatched", "running", "succeeded", "failed", "cancelled"]
State = Literal["ready", "scheduled", "retrying", "running", "dead"]  # store.JOB_STATES


class Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class CsrfOut(Out):
    token: str = Field(description="Send it as X-CSRF-Token with the harvest_csrf cookie.")


class JobOut(Out):
    id: int
    name: str
    queue: str
    status: Status
    priority: int
    attempts: int
    max_attempts: int
    run_at: datetime | None  # None: the stored value cannot be read (the job is quarantined)
    created_at: datetime | None
    dispatched_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    lease_expires_at: datetime | None
    cancel_requested: bool
    last_error: str | None

    @classmethod
    def of(cls, job: Job) -> JobOut:
        return cls(**_job_fields(job))


class JobDetailOut(JobOut):
    payload: dict[str, Any] | None
    result: Any = None
    idempotency_key: str | None
    last_traceback: str | None

    @classmethod
    def of(cls, job: Job) -> JobDetailOut:
        return cls(
            **_job_fields(job),
            payload=job.payload,
            result=job.result,
            idempotency_key=job.idempotency_key,
            last_traceback=job.last_traceback,
        )


def _job_fields(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "queue": job.queue,
        "status": job.status.value,
        "priority": job.priority,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "run_at": job.run_at,
        "created_at": job.created_at,
        "dispatched_at": job.dispatched_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "lease_expires_at": job.lease_expires_at,
        "cancel_requested": job.cancel_requested,
        "last_error": job.last_error,
    }


class JobPageOut(Out):
    jobs: list[JobOut]
    older: int | None = Field(description="Pass as before= for the next (older) page.")
    newer: int | None = Field(description="Pass as after= for the previous (newer) page.")


class DepthOut(Out):
    queue: str
    status: str
    jobs: int


class Percentiles(Out):
    p50: float
    p95: float
    p99: float


class WindowOut(Out):
    succeeded: int
    failed: int
    cancelled: int
    retried: int
    throughput_per_second: float
    wait_seconds: Percentiles | None = Field(description="Enqueue (due) to start.")
    run_seconds: Percentiles | None = Field(description="Start to finish, successful runs.")


class MinuteOut(Out):
    minute: datetime
    succeeded: int
    failed: int
    cancelled: int
    wait_seconds: Percentiles | None
    run_seconds: Percentiles | None


class KeyOut(Out):
    id: int
    pool: str
    name: str
    hint: str = Field(description="The masked secret (sk-…abcd); the secret is never sent.")
    status: Literal["active", "cooling", "disabled"]
    stored_status: Literal["active", "cooling", "disabled"]
    max_concurrency: int
    rate_limit: str | None
    live_leases: int | None
    utilisation: float | None
    learned: str | None = Field(
        description="Limits lowered by 429s (C now/declared, R now/declared) and what the "
        "service's headers said is left; 'as declared' when none."
    )
    cooldown_until: datetime | None
    last_used_at: datetime | None


class PoolOut(Out):
    pool: str
    loaded: bool
    leases: int
    capacity: int
    utilisation: float | None
    active: int
    cooling: int
    disabled: int
    keys: list[KeyOut]


class PoolsOut(Out):
    pools: list[PoolOut]
    note: str | None = Field(description="Why the live state is missing (Redis down).")


class OverviewOut(Out):
    depth: list[DepthOut]
    by_status: dict[str, int]
    last_minute: WindowOut
    counters: dict[str, int]
    minutes: list[MinuteOut]
    pools: PoolsOut


class DeadOut(Out):
    total: int
    by_name: dict[str, int]


class Matching(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str | None, AfterValidator(filters.job_name)] = Field(
        default=None, min_length=1, max_length=NAME_MAX,
        description="Only dead jobs of this exact name (all when absent).",
    )  # fmt: skip
    limit: int | None = Field(
        default=None, ge=1, le=MAX_COUNT,
        description="Touch at most this many (oldest first): send the count you were shown "
        "(GET /api/dead) so that jobs that died since are left alone. All when absent.",
    )  # fmt: skip


class ActionOut(Out):
    ok: bool
    detail: str
    count: int | None = None


class ScheduleOut(Out):
    id: int
    name: str
    job: str
    payload: dict[str, Any]
    cron: str | None
    every_seconds: float | None
    timezone: str
    enabled: bool
    misfire: str
    priority: int
    next_run_at: datetime
    last_fired_at: datetime | None

    @classmethod
    def of(cls, s: Schedule) -> ScheduleOut:
        return cls(
            id=s.id, name=s.name, job=s.job, payload=s.payload, cron=s.cron,
            every_seconds=s.every, timezone=s.timezone, enabled=s.enabled,
            misfire=str(s.misfire), priority=s.priority, next_run_at=s.next_run_at,
            last_fired_at=s.last_fired_at,
        )  # fmt: skip


class BatchOut(Out):
    id: int
    total: int
    succeeded: int
    failed: int
    cancelled: int
    pending: int
    complete: bool
    on_complete: str | None
    callback_job_id: int | None
    created_at: datetime
    completed_at: datetime | None

    @classmethod
    def of(cls, b: Batch) -> BatchOut:
        return cls(
            id=b.id, total=b.total, succeeded=b.succeeded, failed=b.failed,
            cancelled=b.cancelled, pending=b.pending, complete=b.complete,
            on_complete=b.on_complete, callback_job_id=b.callback_job_id,
            created_at=b.created_at, completed_at=b.completed_at,
        )  # fmt: skip


def pools_out(pools: list[data.PoolView] | str) -> PoolsOut:
    if isinstance(pools, str):
        return PoolsOut(pools=[], note=pools)
    return PoolsOut(pools=[_pool_out(p) for p in pools], note=None)


def _pool_out(p: data.PoolView) -> PoolOut:
    use = p.use
    return PoolOut(
        pool=use.pool, loaded=use.loaded, leases=use.leases, capacity=use.capacity,
        utilisation=use.utilisation, active=use.count("active"), cooling=use.count("cooling"),
        disabled=use.count("disabled"), keys=[_key_out(k) for k in p.keys],
    )  # fmt: skip


def _key_out(k: data.KeyView) -> KeyOut:
    i = k.info
    return KeyOut(
        id=i.id, pool=i.pool, name=i.name, hint=i.hint, status=k.status,
        stored_status=i.status, max_concurrency=i.max_concurrency, rate_limit=i.rate_limit,
        live_leases=k.leases, utilisation=k.utilisation, learned=k.learned,
        cooldown_until=k.cooldown_until,
        last_used_at=i.last_used_at,
    )  # fmt: skip


class ProcessOut(BaseModel):
    id: str
    hostname: str
    pid: int
    queues: list[str]
    pool: str
    concurrency: int
    async_concurrency: int
    started_at: float
    last_seen: float
    in_flight: int
    jobs: list[dict[str, Any]]


class AttemptOut(BaseModel):
    attempt: int
    worker: str | None
    started_at: datetime | None
    ended_at: datetime
    seconds: float | None
    outcome: str
    error: str | None
