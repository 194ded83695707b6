"""``harvest demo``: harvest end to end against a local rate-limited API, with a live
progress bar and a summary. Registered in :mod:`harvest.cli`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from harvest.cli_common import _triple, out
from harvest.cli_tables import Column, fit

if TYPE_CHECKING:
    from harvest.demo import DemoResult, DemoServices

# --- demo -----------------------------------------------------------------------------------


def demo_cmd(
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000, help="How many jobs.")] = 3000,
    concurrency: Annotated[
        int, typer.Option(min=1, max=64, help="Execution processes (each runs many jobs at once).")
    ] = 2,
    timeout: Annotated[float, typer.Option(help="Give up waiting after this many seconds.")] = 600,
    database: Annotated[
        str, typer.Option(help="The demo's own database (created when missing).")
    ] = "harvest_demo",
    drop: Annotated[
        bool, typer.Option("--drop", help="Drop the demo's database at the end.")
    ] = False,
) -> None:
    """Run harvest end to end against a local rate-limited API, with a summary.

    Services (it says which), its own database (harvest_demo, never harvest's default one),
    migrations, a local API on loopback with per-key limits (429 + Retry-After, some 500s), a
    pool of demo keys, workers and beat, N "harvest a page" jobs with a live progress bar;
    then it stops everything it started."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harvest import demo

    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=out) as bar:
        enq = bar.add_task("enqueued", total=jobs, detail="")
        run = bar.add_task("finished", total=jobs, detail="")
        keys = bar.add_task("key leases", total=None, detail="")

        def progress(p: demo.Progress) -> None:
            bar.update(run, completed=p.done, detail=f"running {p.running}, failed {p.failed}")
            bar.update(
                keys,
                completed=p.leases,
                total=p.capacity or None,
                detail=f"in use; keys cooling {p.cooling}, 429s {p.http_429}",
            )

        result = demo.run(
            jobs=jobs,
            concurrency=concurrency,
            timeout=timeout,
            database=database,
            drop=drop,
            on_services=lambda found: bar.console.print(_demo_services(found)),
            on_enqueued=lambda n: bar.update(enq, completed=n),
            on_progress=progress,
        )
    _demo_outcome(result)
    if result.unfinished:
        raise typer.Exit(1)


def _demo_outcome(result: DemoResult) -> None:
    """The summary, the keys, and what became of the demo's database."""
    out.print(_demo_summary(result))
    out.print(_demo_keys(result))
    if result.dropped:
        out.print(f"database {result.database} dropped", markup=False)
    else:
        out.print(
            f"database {result.database} kept, with this run's jobs (HARVEST_DATABASE_URL="
            f"{result.services} harvest jobs ls); `harvest demo --drop` drops it after a run",
            markup=False,
        )


def _demo_services(found: DemoServices) -> Table:
    """What the demo runs against, before it starts."""
    table = Table(show_header=False, title="harvest demo uses")
    created = "created for the demo" if found.database_created else "already there"
    table.add_row("postgres", f"{found.postgres}\n{found.postgres_from}; database {created}")
    table.add_row("redis", f"{found.redis}\n{found.redis_from}")
    table.add_row("logs", f"{found.logs} (schedule worker, execution worker, beat)")
    if found.recorded is not None:
        table.add_row("recorded", f"{found.recorded}, until the demo stops its servers")
    return table


def _demo_summary(result: DemoResult) -> Table:
    w = result.window
    table = Table("figure", "value", title=f"harvest demo: {result.jobs} jobs")
    table.add_row("succeeded", str(w.succeeded))
    table.add_row("retried (succeeded or not)", str(w.retried))
    table.add_row("failed (dead)", str(w.failed))
    table.add_row("not finished", json.dumps(result.unfinished) if result.unfinished else "0")
    table.add_row("jobs/s", f"{result.jobs / result.elapsed:.0f}")
    table.add_row("enqueue-to-start p50/p95/p99", _triple(w.wait_p))
    table.add_row("run time p50/p95/p99", _triple(w.run_p))
    table.add_row("429s seen (key rested, job retried)", str(result.http_429))
    table.add_row("HTTP 500s seen (retried)", str(result.http_500))
    table.add_row("keys", f"{len(result.keys)} in pool {result.pool!r}")
    return table


_DEMO_KEY_COLUMNS = tuple(
    Column(h)
    for h in ("key", "max conc.", "declared rate", "the API allows", "200s", "429s", "500s")
)


def _demo_keys(result: DemoResult) -> Table:
    cells = [
        (k.name, str(k.max_concurrency), k.rate or "not declared", k.api_limit, str(k.ok),
         str(k.http_429), str(k.http_500))
        for k in result.keys
    ]  # fmt: skip
    title = f"keys of pool {result.pool!r} (secrets made up for the run, never shown)"
    return fit(_DEMO_KEY_COLUMNS, cells, width=out.width, title=title)
