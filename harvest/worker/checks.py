"""Fail fast: a worker or beat that cannot do its work exits at start, with one line on stderr
naming the problem (secrets masked) and a non-zero code, instead of saying "ready" and then
logging a traceback per tick.

Checked, in order: the settings (``HARVEST_*``), the modules of ``HARVEST_IMPORTS`` (found and
importable), Postgres (answers, and is migrated up to this version's head), and the
coordination Redis (answers PING). Each check has a short timeout, so the whole takes a few
seconds at most. Exit codes: 78 (EX_CONFIG) for configuration, 69 (EX_UNAVAILABLE) for a
service that does not answer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

import psycopg
import redis

from harvest.errors import ConfigurationError, HarvestError, StartupProblem
from harvest.redact import redact_text, redact_url
from harvest.settings import Settings, load_settings

log = logging.getLogger(__name__)

EX_UNAVAILABLE = 69
EX_CONFIG = 78
TIMEOUT = 3  # seconds, per service


def settings_or_exit() -> Settings:
    """The settings, read when harvest's Celery app is imported. Under Celery's command line a
    bad setting exits with one line; imported as a library it raises ConfigurationError."""
    try:
        return load_settings()
    except HarvestError as exc:
        if "celery.bin.celery" in sys.modules:
            _exit("harvest", StartupProblem(EX_CONFIG, str(exc)))
        raise


def worker_starting(**_: Any) -> None:
    """``celeryd_init``: before the worker is configured or says anything."""
    _run("harvest worker")


def beat_starting(**_: Any) -> None:
    """``beat_init``: before beat sends its first tick."""
    _run("harvest beat")


def problems(settings: Settings | None = None) -> None:
    """Raise StartupProblem for the first thing that stops a worker or beat from working."""
    try:
        settings = settings or load_settings()
        _imports(settings)
    except ConfigurationError as exc:
        raise StartupProblem(EX_CONFIG, str(exc)) from None
    _postgres(settings)
    _redis(settings)


def _run(role: str) -> None:
    try:
        problems()
    except StartupProblem as exc:
        _exit(role, exc)


def refuse(role: str, line: str) -> NoReturn:
    """Exit at start with one line naming a configuration harvest cannot run safely."""
    _exit(role, StartupProblem(EX_CONFIG, line))


def _exit(role: str, problem: StartupProblem) -> NoReturn:
    line = " ".join(redact_text(str(problem)).split())
    stream = sys.__stderr__ or sys.stderr  # beat has redirected sys.stderr into its logger
    stream.write(f"{role}: {line}\n")
    stream.flush()
    raise SystemExit(problem.code)


def _imports(settings: Settings) -> None:
    from harvest.app import Harvest

    app = Harvest(settings)
    app.load_imports()
    if settings.imports and not app.jobs:
        log.warning("HARVEST_IMPORTS (%s) registers no job", ", ".join(settings.imports))


def _postgres(settings: Settings) -> None:
    """Postgres answers, and its schema is at this version's head (or at a newer one: a newer
    harvest migrated it first, as a rolling deploy does)."""
    from harvest import migrate

    where = redact_url(settings.database_url)
    try:
        with psycopg.connect(settings.psycopg_url, connect_timeout=TIMEOUT) as conn:
            row = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (migrate.VERSION_TABLE,)
            ).fetchone()
            revision = None
            if row is not None and row[0]:
                found = conn.execute(f"SELECT version_num FROM {migrate.VERSION_TABLE}").fetchone()
                revision = found[0] if found else None
            if settings.pooled:
                _warn_without_timeouts(conn)
    except psycopg.Error as exc:
        detail = str(exc).strip().splitlines()
        raise StartupProblem(
            EX_UNAVAILABLE,
            f"Postgres is unavailable at {where}: {detail[0] if detail else type(exc).__name__}",
        ) from None
    if revision is None:
        raise StartupProblem(
            EX_CONFIG, f"the database {where} is not migrated: run `harvest db upgrade`"
        )
    behind = migrate.behind(settings, revision)
    if behind:
        raise StartupProblem(
            EX_CONFIG,
            f"the database {where} is at revision {revision}, this harvest needs {behind}: "
            "run `harvest db upgrade`",
        )


def _warn_without_timeouts(conn: psycopg.Connection[Any]) -> None:
    """Behind a transaction pooler harvest sends no timeouts: say so when the role (or the
    database) sets none either."""
    unset = [
        name
        for name in ("statement_timeout", "idle_in_transaction_session_timeout")
        if (conn.execute(f"SHOW {name}").fetchone() or ("0",))[0] in ("0", "0ms")
    ]
    if unset:
        log.warning(
            "HARVEST_DATABASE_POOLER=transaction: harvest sends no %s; the role sets none "
            "either, so a stuck session can hold row locks: ALTER ROLE ... SET %s = '...'",
            " or ".join(unset),
            unset[0],
        )


def _redis(settings: Settings) -> None:
    client = redis.Redis.from_url(
        settings.redis_url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT
    )
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        detail = str(exc).strip().splitlines()
        raise StartupProblem(
            EX_UNAVAILABLE,
            f"Redis is unavailable at {redact_url(settings.redis_url)}: "
            f"{detail[0] if detail else type(exc).__name__}",
        ) from None
    finally:
        client.close()
