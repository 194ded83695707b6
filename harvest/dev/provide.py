"""Choosing a source for each service in one ``up`` call: the environment, a server an earlier
``up`` started, the machine's service on the default address, or a new private server."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from harvest.dev.host import alive, port_open
from harvest.dev.postgres_server import (
    create_database,
    pg_admin_problem,
    pg_url,
    start_postgres,
)
from harvest.dev.redis_server import redis_problem, redis_url, start_redis
from harvest.dev.state import (
    DATABASE_ENV,
    LOOPBACK,
    PROBE_TIMEOUT,
    READY_TIMEOUT,
    REDIS_ENV,
    Address,
    Binaries,
    DevState,
    ServerRecord,
    replace_servers,
    write_state,
)
from harvest.dev.stopping import process_markers, stop_all


@dataclass
class UpCall:
    """One ``up`` call: its inputs, and what it noted and started so far."""

    sdir: Path
    env: Mapping[str, str]
    binaries: Binaries
    previous: DevState | None
    timeout: float
    notes: list[str] = field(default_factory=list)
    started: list[ServerRecord] = field(default_factory=list)

    def recorded(self, kind: str) -> ServerRecord | None:
        """The server of that kind an earlier ``up`` started, if it still runs."""
        old = self.previous.server(kind) if self.previous else None
        return old if old is not None and alive(old.pid, *process_markers(old)) else None


@dataclass(frozen=True)
class Provided:
    url: str
    source: str
    server: ServerRecord | None = None


def provide_postgres(ctx: UpCall, probe: Address | None, database: str) -> Provided:
    if ctx.env.get(DATABASE_ENV):
        return Provided(ctx.env[DATABASE_ENV], "env")
    old = ctx.recorded("postgres")
    if old is not None and not pg_admin_problem(old.port, 2):
        create_database(LOOPBACK, old.port, database, ctx.timeout)
        return Provided(pg_url(LOOPBACK, old.port, database), "started", old)
    if probe is not None and _default_postgres_usable(probe, ctx.notes):
        create_database(probe[0], probe[1], database, ctx.timeout)
        return Provided(pg_url(probe[0], probe[1], database), "default")
    record = start_postgres(ctx.sdir, ctx.binaries, ctx.timeout, ctx.notes)
    ctx.started.append(record)
    create_database(LOOPBACK, record.port, database, ctx.timeout)
    return Provided(pg_url(LOOPBACK, record.port, database), "started", record)


def provide_redis(ctx: UpCall, probe: Address | None) -> Provided:
    if ctx.env.get(REDIS_ENV):
        return Provided(ctx.env[REDIS_ENV], "env")
    old = ctx.recorded("redis")
    if old is not None and not redis_problem(redis_url(LOOPBACK, old.port), 2):
        return Provided(redis_url(LOOPBACK, old.port), "started", old)
    if probe is not None and _default_redis_usable(probe, ctx.notes):
        return Provided(redis_url(*probe), "default")
    record = start_redis(ctx.sdir, ctx.binaries, ctx.timeout)
    ctx.started.append(record)
    return Provided(redis_url(LOOPBACK, record.port), "started", record)


def _default_postgres_usable(probe: Address, notes: list[str]) -> bool:
    host, port = probe
    if not port_open(host, port):
        return False
    problem = pg_admin_problem(port, PROBE_TIMEOUT, host)
    if problem:
        notes.append(
            f"{host}:{port} answers but not as Postgres with user postgres and no password "
            f"({problem}): started a private server"
        )
    return not problem


def _default_redis_usable(probe: Address, notes: list[str]) -> bool:
    host, port = probe
    if not port_open(host, port):
        return False
    problem = redis_problem(redis_url(host, port), PROBE_TIMEOUT)
    if problem:
        notes.append(f"{host}:{port} does not answer PING ({problem}): started a private server")
    return not problem


def rollback(ctx: UpCall) -> None:
    """Stop what a failed ``up`` started; record what could not be stopped, for ``down``."""
    if not ctx.started:
        return
    _, left, _ = stop_all(tuple(ctx.started), READY_TIMEOUT)
    if left:
        base = ctx.previous or DevState(str(ctx.sdir), "", "", "none", "none")
        write_state(ctx.sdir, replace_servers(base, [*base.servers, *left]))
