"""``harvest enqueue`` and ``harvest jobs ls|show|cancel`` (``retry`` is in
:mod:`harvest.cli_schedules`). Registered in :mod:`harvest.cli`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from harvest.cli_common import _app, _Lazy, out
from harvest.cli_tables import Column, fit, when
from harvest.errors import InvalidOption
from harvest.validation import payload_from_json

if TYPE_CHECKING:
    from harvest import history, store
    from harvest.jobs import Job
else:
    history, store = (_Lazy(f"harvest.{name}") for name in ("history", "store"))

jobs_cli = typer.Typer(help="Look at and act on jobs.")


def _fmt_time(value: datetime | None) -> str:
    return value.isoformat(timespec="milliseconds") if value else "-"


# --- enqueue and jobs -----------------------------------------------------------------------


def enqueue(
    name: Annotated[str, typer.Argument(help="A job registered in HARVEST_IMPORTS.")],
    *,
    payload: Annotated[
        str, typer.Option(help="The handler's keyword arguments as a JSON object.")
    ] = "{}",
    delay: Annotated[float | None, typer.Option(help="Seconds before it is due.")] = None,
    priority: Annotated[int, typer.Option(help="-1000..1000, higher first.")] = 0,
    idempotency_key: Annotated[str | None, typer.Option(help="Enqueue once per key.")] = None,
    tenant: Annotated[
        str | None, typer.Option(help="Fairness key: dispatch shares capacity by tenant.")
    ] = None,
) -> None:
    """Enqueue one job and print its id."""
    data = payload_from_json(payload)
    app = _app()
    ref = app.enqueue(
        name,
        data,
        delay=delay,
        priority=priority,
        idempotency_key=idempotency_key,
        tenant=tenant,
    )
    out.print(f"{ref.id}" if ref.created else f"{ref.id} (already enqueued with this key)")


@jobs_cli.command("ls")
def jobs_ls(
    status: Annotated[str | None, typer.Option(help="pending, running, failed, ...")] = None,
    name: Annotated[str | None, typer.Option(help="Only jobs of this name.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    search: Annotated[
        str | None, typer.Option(help="42 | part of a name | name = x | payload.url = https://x")
    ] = None,
) -> None:
    """List jobs, newest first."""
    from harvest.db import translate_errors
    from harvest.models import JobStatus
    from harvest.search import parse

    known = [s.value for s in JobStatus]
    if status is not None and status not in known:
        raise InvalidOption("status", f"must be one of {', '.join(known)}, got {status!r:.80}")
    found = parse(search) if search is not None else None
    app = _app()
    with translate_errors(), app.engine.begin() as conn:  # begin: a quarantine is kept
        rows = store.list_jobs(conn, status=status, name=name, search=found, limit=limit)
    columns = (
        Column("id"), Column("name"), Column("status"), Column("attempts"),
        Column("priority", 100), Column("run at"), Column("last error"),
    )  # fmt: skip
    cells = [_job_row(job, out.width) for job in rows]
    out.print(fit(columns, cells, width=out.width))


def _job_row(job: Job, width: int) -> tuple[str, ...]:
    return (
        str(job.id), job.name, job.status, f"{job.attempts}/{job.max_attempts}",
        str(job.priority), when(job.run_at, width), (job.last_error or "")[:60],
    )  # fmt: skip


@jobs_cli.command("show")
def jobs_show(job_id: int) -> None:
    """Everything about one job: attempts, timings, result, last error with its traceback."""
    app = _app()
    job = app.get(job_id)
    out.print(_job_table(job))
    with app.engine.connect() as conn:
        attempts = history.attempts(conn, job_id)
    if attempts:
        out.print(_attempts_table(attempts))
    if job.last_traceback:
        out.print("[bold]last traceback[/bold]")
        out.print(job.last_traceback, markup=False)


def _attempts_table(attempts: list[history.Attempt]) -> Table:
    table = Table("attempt", "started", "ended", "run time", "worker", "outcome", "error",
                  title="attempts (the last 20)")  # fmt: skip
    for a in attempts:
        run = "-" if a.seconds is None else f"{a.seconds:.2f} s"
        table.add_row(
            str(a.attempt), _fmt_time(a.started_at), _fmt_time(a.ended_at), run,
            a.worker or "-", a.outcome, (a.error or "")[:200],
        )  # fmt: skip
    return table


def _job_table(job: Job) -> Table:
    table = Table(show_header=False, title=f"job {job.id}")
    rows: list[tuple[str, Any]] = [
        ("name", job.name),
        ("queue", job.queue),
        ("status", job.status),
        ("attempts", f"{job.attempts}/{job.max_attempts}"),
        ("priority", job.priority),
        ("tenant", job.tenant or "-"),
        ("payload", json.dumps(job.payload)[:500]),
        ("result", json.dumps(job.result)[:500]),
        ("idempotency key", job.idempotency_key or "-"),
        ("created", _fmt_time(job.created_at)),
        ("run at", _fmt_time(job.run_at)),
        ("dispatched", _fmt_time(job.dispatched_at)),
        ("started", _fmt_time(job.started_at)),
        ("finished", _fmt_time(job.finished_at)),
        ("lease expires", _fmt_time(job.lease_expires_at)),
        ("last error", job.last_error or "-"),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    return table


@jobs_cli.command("cancel")
def jobs_cancel(job_id: int) -> None:
    """Cancel a job (pending: at once; running: asked to stop)."""
    status = _app().cancel(job_id)
    out.print(f"job {job_id}: {status}")
