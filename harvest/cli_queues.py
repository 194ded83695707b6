"""``harvest queues ls|pause|resume``: pause a queue (dispatch claims none of its jobs, kept in
Postgres) and resume it. See :mod:`harvest.queues`.

Registered by ``harvest/cli.py`` (``cli.add_typer(queues_cli, name="queues")``). Printing
follows cli.py: a Rich table on stdout; a user mistake (unknown or malformed queue) is a
:class:`~harvest.errors.HarvestError` that ``harvest.cli.main`` prints as one line on stderr
with a non-zero exit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console

from harvest.cli_tables import Column, fit, when

if TYPE_CHECKING:  # imported where used: `harvest --help` stays quick
    from harvest.app import Harvest
    from harvest.queues import Queue, QueueChange

out = Console(highlight=False)

queues_cli = typer.Typer(
    help="Queues: pending and running jobs; pause and resume dispatch (kept in Postgres).",
    no_args_is_help=True,
)


def _app() -> Harvest:
    from harvest.app import Harvest
    from harvest.settings import load_settings

    app = Harvest(load_settings())
    app.load_imports()
    return app


@queues_cli.command("ls")
def queues_ls() -> None:
    """List queues: pending (due now), running, and whether dispatch is paused."""
    app = _app()
    try:
        rows = app.list_queues()
    finally:
        app.close()
    if not rows:
        out.print("no queues")
        return
    columns = (
        Column("queue"), Column("pending"), Column("due now"), Column("running"),
        Column("state"), Column("paused at", 100),
    )  # fmt: skip
    cells = [_row(q, out.width) for q in rows]
    out.print(fit(columns, cells, width=out.width, title="queues"))


def _row(q: Queue, width: int) -> tuple[str, ...]:
    return (
        q.name, str(q.pending), str(q.ready), str(q.running),
        "paused" if q.paused else "active", when(q.paused_at, width),
    )  # fmt: skip


def _toggle(name: str, *, paused: bool) -> QueueChange:
    app = _app()
    try:
        return app.pause_queue(name) if paused else app.resume_queue(name)
    finally:
        app.close()


@queues_cli.command("pause")
def queues_pause(name: str) -> None:
    """Stop dispatching a queue's jobs (enqueue still stores them) until it is resumed."""
    done = _toggle(name, paused=True)
    already = "" if done.changed else " (it already was)"
    shown = f"queue {done.queue.name}: paused{already}, {done.queue.pending} pending"
    out.print(shown, markup=False)


@queues_cli.command("resume")
def queues_resume(name: str) -> None:
    """Dispatch a paused queue's jobs again."""
    done = _toggle(name, paused=False)
    already = "" if done.changed else " (it was not paused)"
    shown = f"queue {done.queue.name}: active{already}, {done.queue.ready} due now"
    out.print(shown, markup=False)
