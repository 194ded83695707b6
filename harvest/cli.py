"""The ``harvest`` command line (Typer + Rich): its groups and commands are registered here,
and written in ``harvest/cli_*.py`` by group; those modules are the only ones that print.

A user mistake (unknown job, bad JSON, unreachable database) is one clear line on stderr and
a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, NoReturn

import click
import typer

from harvest.cli_common import _first_line, _Lazy, err, out
from harvest.cli_demo import demo_cmd
from harvest.cli_dev import db_cli, dev_cli
from harvest.cli_jobs import enqueue, jobs_cli
from harvest.cli_keys import keys_cli
from harvest.cli_queues import queues_cli
from harvest.cli_schedules import retry_command, schedules_cli
from harvest.cli_stats import metrics_cmd, stats_cmd, top_cmd, workers_cmd
from harvest.cli_web import web_command
from harvest.errors import ConfigurationError, HarvestError, ServiceUnavailable
from harvest.redact import redact_text

if TYPE_CHECKING:
    import redis
    from pydantic import ValidationError
else:
    redis = _Lazy("redis")

cli = typer.Typer(
    name="harvest",
    help="Durable jobs on Celery workers, with Postgres as the source of truth.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cli.add_typer(dev_cli, name="dev")
cli.add_typer(db_cli, name="db")
cli.add_typer(jobs_cli, name="jobs")
cli.add_typer(keys_cli, name="keys")
cli.add_typer(schedules_cli, name="schedules")
cli.add_typer(queues_cli, name="queues")
cli.command("web")(web_command)
cli.command("enqueue")(enqueue)
cli.command("stats")(stats_cmd)
cli.command("workers")(workers_cmd)
cli.command("top")(top_cmd)
cli.command("metrics")(metrics_cmd)
cli.command("demo")(demo_cmd)
jobs_cli.command("retry")(retry_command)


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        out.print(f"harvest {version('harvest')}")
        raise typer.Exit()


@cli.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Durable jobs on Celery workers, with Postgres as the source of truth."""


@contextlib.contextmanager
def _boundary() -> Iterator[None]:
    """Driver errors that escaped a command become one clear line (HarvestError)."""
    try:
        yield
    except HarvestError:
        raise
    except Exception as exc:
        clear = _clear_error(exc)
        if clear is None:
            raise
        raise clear from None


def _clear_error(exc: Exception) -> HarvestError | None:
    """The one-line error for a driver error (imported here: only when one happened)."""
    from alembic.util import CommandError
    from pydantic import ValidationError
    from sqlalchemy.exc import InterfaceError, OperationalError, ProgrammingError

    from harvest.db import unavailable

    if isinstance(exc, OperationalError | InterfaceError):
        return unavailable(exc)
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return ServiceUnavailable("Redis", _first_line(exc))
    if isinstance(exc, ProgrammingError) and getattr(exc.orig, "sqlstate", None) == "42P01":
        return HarvestError("the database has no harvest tables: run `harvest db upgrade` first")
    if isinstance(exc, CommandError):
        return HarvestError(f"migration: {_first_line(exc)}")
    if isinstance(exc, ValidationError):  # the settings, read from HARVEST_* variables
        return ConfigurationError(_bad_settings(exc))
    return None


def _bad_settings(exc: ValidationError) -> str:
    """Which variables are wrong and why; never their values (one may be a secret)."""
    from harvest.settings import explain_invalid

    return explain_invalid(exc)


# Typer >= 0.20 vendors Click (typer._click): its exceptions are not click's. Catch both.
_EXITS = tuple({click.exceptions.Exit, typer.Exit})
_ABORTS = tuple({click.exceptions.Abort, typer.Abort})
_USAGE = tuple({click.ClickException, getattr(typer, "TyperException", click.ClickException)})


def _undecodable_argument(argv: list[str]) -> int | None:
    """The position of the first argument that was not valid UTF-8 (Python keeps its bytes
    as lone surrogates), or None."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return i
    return None


def main() -> None:
    command = typer.main.get_command(cli)
    bad = _undecodable_argument(sys.argv[1:])
    if bad is not None:  # never echoed: its bytes are not text, and may be a secret
        err.print(f"error: argument {bad + 1} is not valid UTF-8 text", markup=False)
        sys.exit(2)
    try:
        with _boundary():
            code = command.main(standalone_mode=False, prog_name="harvest")
    except _EXITS as exc:
        sys.exit(getattr(exc, "exit_code", 1))
    except _ABORTS:
        err.print("aborted")
        sys.exit(130)
    except _USAGE as exc:
        _usage_error(exc)
    except HarvestError as exc:
        err.print(f"error: {redact_text(str(exc))}", markup=False)
        sys.exit(1)
    # Without standalone mode, an Exit raised by a command comes back as its exit code.
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: Exception) -> NoReturn:
    """A Click/Typer usage error as one line (`harvest` alone: the help it printed)."""
    exit_code = getattr(exc, "exit_code", 2)
    format_message = getattr(exc, "format_message", None)
    message = format_message() if callable(format_message) else str(exc)
    if type(exc).__name__ == "NoArgsIsHelpError":  # the help is the message (or was printed)
        if message.strip():
            out.print(message, markup=False)
        sys.exit(exit_code)
    line = " ".join(redact_text(message).split())
    err.print(f"error: {line}", markup=False)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
