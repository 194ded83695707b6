"""The JSON API under ``/api``: the dashboard's data and actions, described by the OpenAPI
document at ``/api/openapi.json``.

Every call needs Basic auth; every POST also needs the CSRF token (``GET /api/csrf``) in the
``X-CSRF-Token`` header, with the ``harvest_csrf`` cookie that came with it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from harvest.app import Harvest
from harvest.batches import Batch
from harvest.jobs import Job
from harvest.schedules import Schedule
from harvest.web import data

BIGINT = 9_223_372_036_854_775_807
NO_NUL = r"^[^\x00]*$"  # Postgres text cannot hold NUL

Status = Literal["pending", "dispatched", "running", "succeeded", "failed", "cancelled"]
Id = Annotated[int, Path(ge=1, le=BIGINT, description="The id.")]
Name = Annotated[
    str | None, Query(min_length=1, max_length=200, pattern=NO_NUL, description="A job name.")
]

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "No or wrong credentials (Basic auth)."},
    404: {"description": "No such thing."},
    409: {"description": "The action does not apply in the current state."},
    503: {"description": "Postgres or Redis did not answer."},
}
POST_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    400: {"description": "The body is not JSON."},
    403: {"description": "The CSRF token is missing or does not match the cookie."},
}

router = APIRouter(prefix="/api", responses={401: ERRORS[401], 503: ERRORS[503]})


def _app(request: Request) -> Harvest:
    harvest: Harvest = request.app.state.harvest
    return harvest


# --- models ---------------------------------------------------------------------------------


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
    run_at: datetime
    created_at: datetime
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
    payload: dict[str, Any]
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


def _percentiles(values: tuple[float, float, float] | None) -> Percentiles | None:
    return Percentiles(p50=values[0], p95=values[1], p99=values[2]) if values else None


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

    name: str | None = Field(
        default=None, min_length=1, max_length=200, pattern=NO_NUL,
        description="Only dead jobs of this name (all when absent).",
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
        live_leases=k.leases, utilisation=k.utilisation, cooldown_until=k.cooldown_until,
        last_used_at=i.last_used_at,
    )  # fmt: skip


# --- routes ---------------------------------------------------------------------------------


@router.get("/csrf", summary="A CSRF token for POST calls (and its cookie)")
def csrf(request: Request) -> CsrfOut:
    return CsrfOut(token=request.state.csrf_token)


@router.get("/overview", summary="Depth, throughput, latencies, counters, key pools")
def overview(
    request: Request,
    minutes: Annotated[int, Query(ge=1, le=1440, description="Minutes of history.")] = 30,
) -> OverviewOut:
    view = data.overview(_app(request), count=minutes)
    figures = view.figures
    w = figures.last_minute
    return OverviewOut(
        depth=[DepthOut(queue=q, status=s, jobs=n) for q, s, n in sorted(figures.depth)],
        by_status=view.by_status,
        last_minute=WindowOut(
            succeeded=w.succeeded,
            failed=w.failed,
            cancelled=w.cancelled,
            retried=w.retried,
            throughput_per_second=figures.throughput,
            wait_seconds=_percentiles(w.wait_p),
            run_seconds=_percentiles(w.run_p),
        ),
        counters=figures.counters,
        minutes=[
            MinuteOut(
                minute=m.at,
                succeeded=m.succeeded,
                failed=m.failed,
                cancelled=m.cancelled,
                wait_seconds=_percentiles(m.wait_p),
                run_seconds=_percentiles(m.run_p),
            )
            for m in view.minutes
        ],
        pools=pools_out(view.pools),
    )


@router.get("/jobs", summary="Jobs, newest first, filtered and paginated")
def jobs(
    request: Request,
    *,
    status: Annotated[Status | None, Query(description="Only jobs in this status.")] = None,
    name: Name = None,
    queue: Annotated[str | None, Query(min_length=1, max_length=200, pattern=NO_NUL)] = None,
    batch_id: Annotated[int | None, Query(ge=1, le=BIGINT)] = None,
    before: Annotated[int | None, Query(ge=1, le=BIGINT, description="Older than this id.")] = None,
    after: Annotated[int | None, Query(ge=0, le=BIGINT, description="Newer than this id.")] = None,
    per_page: Annotated[int, Query(ge=1, le=data.MAX_PAGE)] = 50,
) -> JobPageOut:
    where = data.JobFilter(status=status, name=name, queue=queue, batch_id=batch_id)
    page = data.job_page(_app(request), where, before=before, after=after, per_page=per_page)
    return JobPageOut(jobs=[JobOut.of(j) for j in page.jobs], older=page.older, newer=page.newer)


@router.get("/jobs/{job_id}", summary="One job: payload, attempts, error and traceback, timings",
            responses={404: ERRORS[404]})  # fmt: skip
def job(request: Request, job_id: Id) -> JobDetailOut:
    return JobDetailOut.of(data.job(_app(request), job_id))


@router.post("/jobs/{job_id}/retry", summary="Retry a dead job", responses=POST_ERRORS)
def retry_job(request: Request, job_id: Id) -> ActionOut:
    data.retry_job(_app(request), job_id)
    return ActionOut(ok=True, detail=f"job {job_id}: pending")


@router.post("/jobs/{job_id}/cancel", summary="Cancel a job", responses=POST_ERRORS)
def cancel_job(request: Request, job_id: Id) -> ActionOut:
    status = data.cancel_job(_app(request), job_id)
    return ActionOut(ok=True, detail=f"job {job_id}: {status}")


@router.post("/jobs/{job_id}/delete", summary="Delete a dead job", responses=POST_ERRORS)
def delete_job(request: Request, job_id: Id) -> ActionOut:
    data.delete_dead_job(_app(request), job_id)
    return ActionOut(ok=True, detail=f"job {job_id}: deleted")


@router.get("/dead", summary="Dead (failed) jobs by name")
def dead(request: Request) -> DeadOut:
    by_name = {
        name: counts["failed"]
        for name, counts in data.names(_app(request)).items()
        if counts.get("failed")
    }
    return DeadOut(total=sum(by_name.values()), by_name=by_name)


@router.post("/dead/retry", summary="Retry every dead job matching", responses=POST_ERRORS)
def retry_dead(request: Request, match: Annotated[Matching | None, Body()] = None) -> ActionOut:
    n = data.retry_dead(_app(request), name=match.name if match else None)
    return ActionOut(ok=True, detail=f"{n} dead job(s) back to pending", count=n)


@router.post("/dead/delete", summary="Delete every dead job matching", responses=POST_ERRORS)
def delete_dead(request: Request, match: Annotated[Matching | None, Body()] = None) -> ActionOut:
    n = data.delete_dead(_app(request), name=match.name if match else None)
    return ActionOut(ok=True, detail=f"{n} dead job(s) deleted", count=n)


@router.get("/keys", summary="API key pools: masked keys, live leases, utilisation")
def keys(request: Request) -> PoolsOut:
    return pools_out(data.key_pools(_app(request)))


@router.post("/keys/{key_id}/disable", summary="Stop leasing a key", responses=POST_ERRORS)
def disable_key(request: Request, key_id: Id) -> ActionOut:
    info = data.set_key_enabled(_app(request), key_id, enabled=False)
    return ActionOut(ok=True, detail=f"key {info.pool}/{info.name}: disabled")


@router.post("/keys/{key_id}/enable", summary="Lease a key again", responses=POST_ERRORS)
def enable_key(request: Request, key_id: Id) -> ActionOut:
    info = data.set_key_enabled(_app(request), key_id, enabled=True)
    return ActionOut(ok=True, detail=f"key {info.pool}/{info.name}: active")


@router.get("/schedules", summary="Recurring schedules: next fire, last fired")
def schedules(request: Request) -> list[ScheduleOut]:
    return [ScheduleOut.of(s) for s in data.schedules(_app(request))]


@router.post("/schedules/{schedule_id}/pause", summary="Pause a schedule", responses=POST_ERRORS)
def pause_schedule(request: Request, schedule_id: Id) -> ScheduleOut:
    return ScheduleOut.of(data.set_schedule_enabled(_app(request), schedule_id, enabled=False))


@router.post("/schedules/{schedule_id}/resume", summary="Resume a schedule",
             responses=POST_ERRORS)  # fmt: skip
def resume_schedule(request: Request, schedule_id: Id) -> ScheduleOut:
    return ScheduleOut.of(data.set_schedule_enabled(_app(request), schedule_id, enabled=True))


@router.get("/batches", summary="Batches and their progress, newest first")
def batches(
    request: Request,
    before: Annotated[int | None, Query(ge=1, le=BIGINT, description="Older than this id.")] = None,
    per_page: Annotated[int, Query(ge=1, le=data.MAX_PAGE)] = 50,
) -> list[BatchOut]:
    return [BatchOut.of(b) for b in data.batches(_app(request), before=before, per_page=per_page)]


@router.get("/batches/{batch_id}", summary="One batch's progress", responses={404: ERRORS[404]})
def batch(request: Request, batch_id: Id) -> BatchOut:
    return BatchOut.of(data.batch(_app(request), batch_id))
