"""``harvest schedules ls|add|pause|resume|rm`` and ``harvest jobs retry ID | --failed [--name]``.

Registered by ``harvest/cli.py`` (``cli.add_typer(schedules_cli, name="schedules")`` and
``jobs_cli.command("retry")(retry_command)``). Printing as in every cli_* module (cli_common's
``out``): Rich tables on stdout; a user mistake is a :class:`~harvest.errors.HarvestError` that
``harvest.cli.main`` prints as one line on stderr with a non-zero exit.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer

from harvest.cli_common import _app, out
from harvest.cli_tables import Column, fit, when
from harvest.errors import InvalidOption
from harvest.validation import payload_from_json

if TYPE_CHECKING:  # imported where used: `harvest --help` stays quick
    from harvest.schedules import Schedule

schedules_cli = typer.Typer(
    help="Recurring schedules, kept in Postgres (one job per fire time, however many beats run).",
    no_args_is_help=True,
)


def _fmt_time(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _when(s: Schedule) -> str:
    if s.cron is not None:
        return f"cron {s.cron}" + ("" if s.timezone == "UTC" else f" ({s.timezone})")
    return f"every {s.every:g}s"


def _misfire(s: Schedule) -> str:
    from harvest.schedules import Misfire

    return f"catch_up {s.catch_up}" if s.misfire is Misfire.CATCH_UP else str(s.misfire)


@schedules_cli.command("ls")
def schedules_ls() -> None:
    """List schedules with their next and last fire times."""
    app = _app()
    try:
        rows = app.list_schedules()
    finally:
        app.close()
    if not rows:
        out.print("no schedules")
        return
    columns = (
        Column("name"), Column("job"), Column("when"), Column("misfire", 100),
        Column("enabled"), Column("next run"), Column("last fired", 100), Column("payload", 120),
    )  # fmt: skip
    cells = [_row(s, out.width) for s in rows]
    out.print(fit(columns, cells, width=out.width, title="schedules"))


def _row(s: Schedule, width: int) -> tuple[str, ...]:
    return (
        s.name, s.job, _when(s), _misfire(s), "yes" if s.enabled else "paused",
        when(s.next_run_at, width) if s.enabled else "-", when(s.last_fired_at, width),
        json.dumps(s.payload)[:60],
    )  # fmt: skip


@schedules_cli.command("add")
def schedules_add(
    name: Annotated[str, typer.Argument(help="The schedule's unique name.")],
    job: Annotated[str, typer.Argument(help="A job registered in HARVEST_IMPORTS.")],
    *,
    cron: Annotated[
        str | None, typer.Option(help="Cron expression, e.g. '*/5 * * * *' or '@hourly'.")
    ] = None,
    every: Annotated[float | None, typer.Option(help="Seconds between runs (>= 1).")] = None,
    payload: Annotated[str, typer.Option(help="The job's keyword arguments as JSON.")] = "{}",
    timezone: Annotated[str, typer.Option(help="IANA timezone of the cron expression.")] = "UTC",
    misfire: Annotated[
        str, typer.Option(help="Late fire times: skip | run_once | catch_up.")
    ] = "run_once",
    catch_up: Annotated[
        int, typer.Option(help="With --misfire catch_up: run at most this many.")
    ] = 1,
    priority: Annotated[int, typer.Option(help="-1000..1000, higher first.")] = 0,
    paused: Annotated[bool, typer.Option("--paused", help="Create it paused.")] = False,
) -> None:
    """Add a schedule (an existing one of that name is left unchanged)."""
    data = payload_from_json(payload)
    app = _app()
    try:
        s = app.schedule(
            name, job, cron=cron, every=every, payload=data, timezone=timezone, misfire=misfire,
            catch_up=catch_up, priority=priority, enabled=not paused,
        )  # fmt: skip
    finally:
        app.close()
    if s.created:
        out.print(f"schedule {s.name}: {_when(s)}, next run {_fmt_time(s.next_run_at)}")
    else:
        out.print(
            f"schedule {s.name} already exists ({s.job}, {_when(s)}): left unchanged",
            markup=False,
        )


def _set_enabled(name: str, *, enabled: bool) -> Schedule:
    """Resume (True) or pause (False) the schedule ``name``; returns it as it is now."""
    app = _app()
    try:
        return app.resume_schedule(name) if enabled else app.pause_schedule(name)
    finally:
        app.close()


@schedules_cli.command("pause")
def schedules_pause(name: str) -> None:
    """Stop firing a schedule until it is resumed."""
    s = _set_enabled(name, enabled=False)
    out.print(f"schedule {s.name}: paused", markup=False)


@schedules_cli.command("resume")
def schedules_resume(name: str) -> None:
    """Fire a paused schedule again, from its next fire time after now."""
    s = _set_enabled(name, enabled=True)
    out.print(f"schedule {s.name}: next run {_fmt_time(s.next_run_at)}", markup=False)


@schedules_cli.command("rm")
def schedules_rm(name: str) -> None:
    """Delete a schedule (jobs it already enqueued stay)."""
    app = _app()
    try:
        app.delete_schedule(name)
    finally:
        app.close()
    out.print(f"removed schedule {name}", markup=False)


def retry_command(
    job_id: Annotated[int | None, typer.Argument(help="A failed (dead) job's id.")] = None,
    *,
    failed: Annotated[
        bool, typer.Option("--failed", help="Every failed (dead) job instead of one.")
    ] = False,
    name: Annotated[str | None, typer.Option(help="With --failed: only jobs of this name.")] = None,
) -> None:
    """Send dead jobs back to pending, with one more attempt allowed: `retry ID`, or
    `retry --failed [--name NAME]`."""
    if (job_id is None) == (not failed):
        raise InvalidOption("job_id", "give a job id, or --failed (not both)")
    if name is not None and not failed:
        raise InvalidOption("name", "--name goes with --failed")
    app = _app()
    try:
        if job_id is not None:
            app.retry(job_id)
            out.print(f"job {job_id}: pending")
            return
        n = app.retry_failed(name=name)
    finally:
        app.close()
    which = f" of {name}" if name else ""
    out.print(f"{n} failed job(s){which} back to pending", markup=False)
