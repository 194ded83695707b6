"""``harvest dev up|down|status`` (the local Postgres and Redis) and ``harvest db
upgrade|downgrade|current`` (the schema). Registered in :mod:`harvest.cli`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from harvest.cli_common import _Lazy, _settings, out
from harvest.cli_tables import Column, fit
from harvest.redact import redact_url

if TYPE_CHECKING:
    from harvest import dev, migrate
else:
    dev, migrate = (_Lazy(f"harvest.{name}") for name in ("dev", "migrate"))

dev_cli = typer.Typer(help="Local Postgres and Redis for development (embedded when needed).")
db_cli = typer.Typer(help="Schema migrations (Alembic).")


# --- dev ------------------------------------------------------------------------------------


@dev_cli.command("up")
def dev_up() -> None:
    """Give harvest a Postgres and a Redis: the configured ones, the machine's, or private
    servers started in ./.harvest (recorded there for every other command)."""
    state = dev.up()
    table = Table("service", "url", "source", "from", title="harvest dev")
    for service, url, source in (
        ("postgres", state.database_url, state.database_source),
        ("redis", state.redis_url, state.redis_source),
    ):
        table.add_row(service, redact_url(url), source, dev.describe(state, service))
    out.print(table)
    for note in state.notes:
        out.print(f"note: {note}", markup=False)
    out.print(
        f"recorded in {state.state_dir}/{dev.STATE_FILE}: harvest commands run from this folder "
        "use these services unless HARVEST_DATABASE_URL / HARVEST_REDIS_URL say otherwise",
        markup=False,
    )


@dev_cli.command("down")
def dev_down() -> None:
    """Stop the servers `harvest dev up` started (only those); data is kept."""
    stopped = dev.down()
    out.print(f"stopped {len(stopped)} server(s)" if stopped else "nothing to stop")


@dev_cli.command("status")
def dev_status() -> None:
    """What `dev up` recorded, and whether each service answers."""
    status = dev.status()
    if not status.recorded:
        out.print(f"no services recorded in {status.state_dir} (run `harvest dev up`)")
        raise typer.Exit(1)
    columns = (Column("service"), Column("url"), Column("source"), Column("pid"), Column("answers"))
    cells = (
        (s.service, s.url, s.source, str(s.pid or "-"), "yes" if s.answers else f"no: {s.detail}")
        for s in status.services
    )
    out.print(fit(columns, cells, width=out.width))
    if not status.up:
        raise typer.Exit(1)


# --- db -------------------------------------------------------------------------------------


@db_cli.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Migrate the schema up to REVISION (default: head)."""
    settings = _settings()
    migrate.upgrade(settings, revision)
    out.print(f"database at {migrate.current(settings)}")


@db_cli.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()] = "-1") -> None:
    """Migrate the schema down to REVISION (default: one step; `base` drops everything)."""
    settings = _settings()
    migrate.downgrade(settings, revision)
    out.print(f"database at {migrate.current(settings) or 'base'}")


@db_cli.command("current")
def db_current() -> None:
    """Print the schema revision of the database."""
    out.print(migrate.current(_settings()) or "base (not migrated)")
