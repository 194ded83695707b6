"""The JSON API under ``/api``: the dashboard's data and actions, described by the OpenAPI
document at ``/api/openapi.json``; what the routes send and take is in
:mod:`harvest.web.models`.

Every call needs Basic auth; every POST also needs the CSRF token (``GET /api/csrf``) in the
``X-CSRF-Token`` header, with the ``harvest_csrf`` cookie that came with it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Request
from pydantic import AfterValidator

from harvest import search
from harvest.app import Harvest
from harvest.web import data, filters
from harvest.web.filters import BIGINT, NAME_MAX
from harvest.web.models import (
    ActionOut,
    AttemptOut,
    BatchOut,
    CsrfOut,
    DeadOut,
    DepthOut,
    JobDetailOut,
    JobOut,
    JobPageOut,
    Matching,
    MinuteOut,
    OverviewOut,
    Percentiles,
    PoolsOut,
    ProcessOut,
    ScheduleOut,
    State,
    Status,
    WindowOut,
    pools_out,
)

Id = Annotated[int, Path(ge=1, le=BIGINT, description="The id.")]
# Filters: one rule for pages and API (harvest.web.filters): exact match, not blank, no NUL.
Name = Annotated[
    str | None,
    Query(min_length=1, max_length=NAME_MAX, description="A job name (exact match)."),
    AfterValidator(filters.job_name),
]
QueueName = Annotated[
    str | None,
    Query(min_length=1, max_length=NAME_MAX, description="A queue (exact match)."),
    AfterValidator(filters.queue),
]

SEARCH = (
    "Search: an id (42), part of a name (or name = x exactly), or a payload path "
    "(payload.url = https://x, the value as JSON or text). Unreadable: 422."
)


# Read where the request is validated: an unreadable search is a 422 like any other field's.
def _readable(value: str | None) -> str | None:
    if value is not None:
        search.parse(value)  # InvalidSearch is a ValueError: the standard 422 body
    return value


SearchText = Annotated[
    str | None,
    Query(max_length=search.MAX_LENGTH, description=SEARCH),
    AfterValidator(_readable),
]

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "No or wrong credentials (Basic auth)."},
    429: {"description": "Too many failed logins from this address: wait Retry-After seconds."},
    404: {"description": "No such thing."},
    409: {"description": "The action does not apply in the current state."},
    503: {"description": "Postgres or Redis did not answer."},
}
POST_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    400: {"description": "The body is not JSON."},
    403: {"description": "The CSRF token is missing or does not match the cookie."},
}

router = APIRouter(prefix="/api", responses={401: ERRORS[401], 429: ERRORS[429], 503: ERRORS[503]})


def _app(request: Request) -> Harvest:
    harvest: Harvest = request.app.state.harvest
    return harvest


def _percentiles(values: tuple[float, float, float] | None) -> Percentiles | None:
    return Percentiles(p50=values[0], p95=values[1], p99=values[2]) if values else None


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
    queue: QueueName = None,
    batch_id: Annotated[int | None, Query(ge=1, le=BIGINT)] = None,
    state: Annotated[
        State | None,
        Query(
            description="ready (due), scheduled (not due yet), retrying (waiting for its "
            "next attempt), running (dispatched or running), dead (failed)."
        ),
    ] = None,
    before: Annotated[int | None, Query(ge=1, le=BIGINT, description="Older than this id.")] = None,
    after: Annotated[int | None, Query(ge=0, le=BIGINT, description="Newer than this id.")] = None,
    q: SearchText = None,
    per_page: Annotated[int, Query(ge=1, le=data.MAX_PAGE)] = 50,
) -> JobPageOut:
    where = data.JobFilter(status=status, name=name, queue=queue, batch_id=batch_id, state=state,
                           search=search.parse(q) if q is not None else None)  # fmt: skip
    page = data.job_page(_app(request), where, before=before, after=after, per_page=per_page)
    return JobPageOut(jobs=[JobOut.of(j) for j in page.jobs], older=page.older, newer=page.newer)


@router.get("/jobs/{job_id}", summary="One job: payload, attempts, error and traceback, timings",
            responses={404: ERRORS[404]})  # fmt: skip
def job(request: Request, job_id: Id) -> JobDetailOut:
    return JobDetailOut.of(data.job(_app(request), job_id))


@router.get("/processes", summary="Live execution processes and the jobs each holds now")
def live_processes(request: Request) -> list[ProcessOut]:
    return [
        ProcessOut(
            id=p.info.id, hostname=p.info.hostname, pid=p.info.pid, queues=list(p.info.queues),
            pool=p.info.pool, concurrency=p.info.concurrency,
            async_concurrency=p.info.async_concurrency, started_at=p.info.started_at,
            last_seen=p.info.last_seen, in_flight=p.info.in_flight,
            jobs=[
                {"id": j.id, "name": j.name, "status": j.status, "started_at": j.started_at}
                for j in p.jobs
            ],
        )
        for p in data.live_processes(_app(request))
    ]  # fmt: skip


@router.get("/jobs/{job_id}/attempts", summary="A job's last attempts (start, end, worker, "
            "outcome, error), oldest first", responses={404: ERRORS[404]})  # fmt: skip
def job_attempts(request: Request, job_id: Id) -> list[AttemptOut]:
    harvest = _app(request)
    data.job(harvest, job_id)  # 404 for a job that does not exist
    return [
        AttemptOut(
            attempt=a.attempt, worker=a.worker, started_at=a.started_at, ended_at=a.ended_at,
            seconds=a.seconds, outcome=a.outcome, error=a.error,
        )
        for a in data.job_attempts(harvest, job_id)
    ]  # fmt: skip


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


@router.post("/dead/retry", summary="Retry the dead jobs matching (at most limit)",
             responses=POST_ERRORS)  # fmt: skip
def retry_dead(request: Request, match: Annotated[Matching | None, Body()] = None) -> ActionOut:
    match = match or Matching()
    n = data.retry_dead(_app(request), name=match.name, at_most=match.limit)
    return ActionOut(ok=True, detail=f"{n} dead job(s) back to pending", count=n)


@router.post("/dead/delete", summary="Delete the dead jobs matching (at most limit)",
             responses=POST_ERRORS)  # fmt: skip
def delete_dead(request: Request, match: Annotated[Matching | None, Body()] = None) -> ActionOut:
    match = match or Matching()
    n = data.delete_dead(_app(request), name=match.name, at_most=match.limit)
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
