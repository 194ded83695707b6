"""The server-rendered pages (Jinja2, autoescaped) and their form actions.

Every action is a POST form carrying the CSRF token, answered with a redirect (303) to the
page that shows its effect, with a fixed message chosen by a code in the query string (never
text from the query string itself).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from harvest import search, store
from harvest.app import Harvest
from harvest.models import JobStatus
from harvest.web import charts, data, filters
from harvest.web.api import Id
from harvest.web.filters import BIGINT
from harvest.web.models import State, Status

HERE = Path(__file__).resolve().parent
STATUSES = [s.value for s in JobStatus]
MAX_SHOWN = 20_000  # characters of a payload or result shown on a page

router = APIRouter(include_in_schema=False)

env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)

MESSAGES = {
    "retried": "Sent back to pending: it runs again when a worker takes it.",
    "cancelled": "Cancel requested.",
    "deleted": "Deleted.",
    "retried_many": "Dead jobs sent back to pending: {n}.",
    "deleted_many": "Dead jobs deleted: {n}.",
    "disabled": "Key disabled: the pool no longer leases it (leases held now run out).",
    "enabled": "Key enabled: the pool leases it again.",
    "paused": "Schedule paused.",
    "resumed": "Schedule resumed from its next fire time.",
}


# --- formatting -----------------------------------------------------------------------------


def when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"


def ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = (datetime.now(UTC) - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 60:
        text = f"{seconds:.0f}s"
    elif seconds < 3600:
        text = f"{seconds / 60:.0f}m"
    elif seconds < 86400:
        text = f"{seconds / 3600:.1f}h"
    else:
        text = f"{seconds / 86400:.1f}d"
    return f"in {text}" if future else f"{text} ago"


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def triple(values: tuple[float, float, float] | None) -> str:
    return " / ".join(seconds(v) for v in values) if values else "-"


def percent(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "-"


def pretty(value: Any) -> str:
    shown = json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)
    if len(shown) > MAX_SHOWN:
        return shown[:MAX_SHOWN] + f"\n… ({len(shown) - MAX_SHOWN} more characters)"
    return shown


def between(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return "-"
    return seconds((end - start).total_seconds())


def epoch_ago(value: float) -> str:
    return ago(datetime.fromtimestamp(value, UTC)) if value else "-"


env.filters.update(when=when, ago=ago, seconds=seconds, triple=triple, percent=percent,
                   pretty=pretty, epoch_ago=epoch_ago)  # fmt: skip
env.globals.update(
    between=between, STATUSES=STATUSES, STATES=list(store.JOB_STATES), usable=filters.usable
)


def _app(request: Request) -> Harvest:
    harvest: Harvest = request.app.state.harvest
    return harvest


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    done = request.query_params.get("done")
    message = MESSAGES.get(done or "")
    if message and "{n}" in message:
        n = request.query_params.get("n", "")
        message = message.format(n=int(n) if n.isdigit() else "?")
    page = env.get_template(template).render(
        request=request,
        csrf_token=request.state.csrf_token,
        path=request.url.path,
        message=message,
        **context,
    )
    return HTMLResponse(page, status_code=status_code)


def back(path: str, **query: Any) -> RedirectResponse:
    shown = {k: v for k, v in query.items() if v is not None}
    return RedirectResponse(f"{path}?{urlencode(shown)}" if shown else path, status_code=303)


async def form(request: Request) -> dict[str, str]:
    """The fields of an urlencoded form (the first value of each; a blank field is kept, as
    an empty string: it is not the same as a missing one)."""
    body = (await request.body()).decode("utf-8", "replace")
    fields = parse_qs(body, keep_blank_values=True, max_num_fields=100)
    return {k: v[0] for k, v in fields.items()}


# --- overview -------------------------------------------------------------------------------


def overview_charts(minutes: list[data.Minute]) -> dict[str, Markup]:
    labels = [m.at.astimezone(UTC).strftime("%H:%M") for m in minutes]
    throughput = charts.bars(
        "Jobs ended per minute",
        labels,
        [
            charts.Series("succeeded", [m.succeeded for m in minutes]),
            charts.Series("failed", [m.failed for m in minutes]),
            charts.Series("cancelled", [m.cancelled for m in minutes]),
        ],
        box=charts.Box(1240, 220),
    )

    def latency(title: str, pick: str) -> Markup:
        values = [getattr(m, pick) for m in minutes]
        return charts.lines(
            title,
            labels,
            [
                charts.Series(name, [v[i] if v else None for v in values])
                for i, name in enumerate(("p50", "p95", "p99"))
            ],
            unit="s",
        )

    return {
        "throughput": throughput,
        "run": latency("Run time per minute (successful attempts)", "run_p"),
        "wait": latency("Enqueue-to-start per minute (first attempts)", "wait_p"),
    }


@router.get("/", response_class=HTMLResponse)
def overview_page(
    request: Request, minutes: Annotated[int, Query(ge=5, le=1440)] = 30
) -> HTMLResponse:
    view = data.overview(_app(request), count=minutes)
    return render(request, "overview.html", view=view, minutes=minutes,
                  charts=overview_charts(view.minutes), live=True)  # fmt: skip


# --- jobs -----------------------------------------------------------------------------------


@router.get("/jobs", response_class=HTMLResponse)
def jobs_page(
    request: Request,
    *,
    status: Annotated[Status | None, Query()] = None,
    name: Annotated[str | None, Query()] = None,
    queue: Annotated[str | None, Query()] = None,
    batch_id: Annotated[int | None, Query(ge=1, le=BIGINT)] = None,
    state: Annotated[State | None, Query()] = None,
    before: Annotated[int | None, Query(ge=1, le=BIGINT)] = None,
    after: Annotated[int | None, Query(ge=0, le=BIGINT)] = None,
    q: Annotated[str | None, Query()] = None,
    per_page: Annotated[int, Query(ge=1, le=data.MAX_PAGE)] = 50,
) -> HTMLResponse:
    harvest = _app(request)
    # An empty field of the filter form means "any"; anything else follows the one rule.
    where = data.JobFilter(status=status or None, name=filters.job_name(name or None),
                           queue=filters.queue(queue or None), batch_id=batch_id,
                           state=state, search=search.parse(q) if q else None)  # fmt: skip
    page = data.job_page(harvest, where, before=before, after=after, per_page=per_page)
    queues = data.queues(harvest)
    shown = {"status": where.status, "name": where.name, "queue": where.queue,
             "batch_id": batch_id, "state": state, "q": q or None,
             "per_page": per_page if per_page != 50 else None}  # fmt: skip
    return render(
        request, "jobs.html", page=page, where=where, q=q or "", names=list(data.names(harvest)),
        queues=queues, older=_link("/jobs", shown, before=page.older),
        newer=_link("/jobs", shown, after=page.newer),
    )  # fmt: skip


def _link(path: str, filters: dict[str, Any], **cursor: int | None) -> str | None:
    if all(v is None for v in cursor.values()):
        return None
    query = {k: v for k, v in {**filters, **cursor}.items() if v is not None}
    return f"{path}?{urlencode(query)}"


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: Id) -> HTMLResponse:
    job = data.job(_app(request), job_id)
    attempts = data.job_attempts(_app(request), job_id)
    return render(request, "job.html", job=job, attempts=attempts)


@router.post("/jobs/{job_id}/retry")
def job_retry(request: Request, job_id: Id) -> RedirectResponse:
    data.retry_job(_app(request), job_id)
    return back(f"/jobs/{job_id}", done="retried")


@router.post("/jobs/{job_id}/cancel")
def job_cancel(request: Request, job_id: Id) -> RedirectResponse:
    data.cancel_job(_app(request), job_id)
    return back(f"/jobs/{job_id}", done="cancelled")


@router.post("/jobs/{job_id}/delete")
def job_delete(request: Request, job_id: Id) -> RedirectResponse:
    data.delete_dead_job(_app(request), job_id)
    return back("/dead", done="deleted")


# --- dead jobs ------------------------------------------------------------------------------


@router.get("/dead", response_class=HTMLResponse)
def dead_page(
    request: Request,
    name: Annotated[str | None, Query()] = None,
    before: Annotated[int | None, Query(ge=1, le=BIGINT)] = None,
    after: Annotated[int | None, Query(ge=0, le=BIGINT)] = None,
) -> HTMLResponse:
    harvest = _app(request)
    where = data.JobFilter(status="failed", name=filters.job_name(name or None))
    page = data.job_page(harvest, where, before=before, after=after, per_page=50)
    by_name = {n: c["failed"] for n, c in data.names(harvest).items() if c.get("failed")}
    shown = {"name": where.name}
    return render(
        request, "dead.html", page=page, name=where.name, by_name=by_name,
        total=sum(by_name.values()), older=_link("/dead", shown, before=page.older),
        newer=_link("/dead", shown, after=page.newer),
    )  # fmt: skip


@router.post("/dead/retry")
async def dead_retry(request: Request) -> RedirectResponse:
    name, count = _bulk(await form(request))
    n = await _threaded(data.retry_dead, _app(request), name=name, at_most=count)
    return back("/dead", done="retried_many", n=n, name=name)


@router.post("/dead/delete")
async def dead_delete(request: Request) -> RedirectResponse:
    name, count = _bulk(await form(request))
    n = await _threaded(data.delete_dead, _app(request), name=name, at_most=count)
    return back("/dead", done="deleted_many", n=n, name=name)


def _bulk(fields: dict[str, str]) -> tuple[str | None, int]:
    """The set a bulk form names: one exact name (or every dead job when the form has no name
    field) and the count it showed, the most it may touch. Refused (422) when unusable."""
    return filters.job_name(fields.get("name")), filters.count(fields.get("count"))


async def _threaded(func: Any, *args: Any, **kwargs: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(func, *args, **kwargs)


# --- keys, schedules, batches ---------------------------------------------------------------


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    """Browsers ask for it whatever the page says; the same icon as the pages link to."""
    return FileResponse(HERE / "static" / "favicon.svg", media_type="image/svg+xml")


@router.get("/processes", response_class=HTMLResponse)
def processes_page(request: Request) -> HTMLResponse:
    return render(request, "processes.html", processes=data.live_processes(_app(request)))


@router.get("/keys", response_class=HTMLResponse)
def keys_page(request: Request) -> HTMLResponse:
    return render(request, "keys.html", pools=data.key_pools(_app(request)))


@router.post("/keys/{key_id}/disable")
def key_disable(request: Request, key_id: Id) -> RedirectResponse:
    data.set_key_enabled(_app(request), key_id, enabled=False)
    return back("/keys", done="disabled")


@router.post("/keys/{key_id}/enable")
def key_enable(request: Request, key_id: Id) -> RedirectResponse:
    data.set_key_enabled(_app(request), key_id, enabled=True)
    return back("/keys", done="enabled")


@router.get("/schedules", response_class=HTMLResponse)
def schedules_page(request: Request) -> HTMLResponse:
    return render(request, "schedules.html", schedules=data.schedules(_app(request)))


@router.post("/schedules/{schedule_id}/pause")
def schedule_pause(request: Request, schedule_id: Id) -> RedirectResponse:
    data.set_schedule_enabled(_app(request), schedule_id, enabled=False)
    return back("/schedules", done="paused")


@router.post("/schedules/{schedule_id}/resume")
def schedule_resume(request: Request, schedule_id: Id) -> RedirectResponse:
    data.set_schedule_enabled(_app(request), schedule_id, enabled=True)
    return back("/schedules", done="resumed")


@router.get("/batches", response_class=HTMLResponse)
def batches_page(
    request: Request, before: Annotated[int | None, Query(ge=1, le=BIGINT)] = None
) -> HTMLResponse:
    found = data.batches(_app(request), before=before, per_page=50)
    older = f"/batches?before={found[-1].id}" if len(found) == 50 else None
    return render(request, "batches.html", batches=found, older=older)


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
def batch_page(request: Request, batch_id: Id) -> HTMLResponse:
    harvest = _app(request)
    found = data.batch(harvest, batch_id)
    members = data.job_page(harvest, data.JobFilter(batch_id=batch_id), per_page=50)
    return render(request, "batch.html", batch=found, members=members)
