"""The ``harvest`` command line (Typer + Rich). The only module that prints.

A user mistake (unknown job, bad JSON, unreachable database) is one clear line on stderr and
a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import click
import redis
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session

from harvest import dev, keystore, migrate, stats, store
from harvest.app import Harvest
from harvest.cli_schedules import retry_command, schedules_cli
from harvest.cli_web import web_command
from harvest.coordination.key_pool import KeyPool, KeyState
from harvest.db import make_engine, translate_errors
from harvest.errors import (
    ConfigurationError,
    HarvestError,
    InvalidKey,
    InvalidPayload,
    PoolNotLoaded,
    ServiceUnavailable,
)
from harvest.jobs import Job
from harvest.redact import redact_text, redact_url
from harvest.settings import Settings, load_settings
from harvest.validation import MAX_DEPTH

if TYPE_CHECKING:
    from harvest.demo import DemoResult

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

cli = typer.Typer(
    name="harvest",
    help="Durable jobs on Celery workers, with Postgres as the source of truth.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
dev_cli = typer.Typer(help="Local Postgres and Redis for development (embedded when needed).")
db_cli = typer.Typer(help="Schema migrations (Alembic).")
jobs_cli = typer.Typer(help="Look at and act on jobs.")
cli.add_typer(dev_cli, name="dev")
cli.add_typer(db_cli, name="db")
keys_cli = typer.Typer(help="API keys: secrets encrypted in Postgres, live leases in Redis.")
cli.add_typer(jobs_cli, name="jobs")
cli.add_typer(keys_cli, name="keys")
cli.add_typer(schedules_cli, name="schedules")
cli.command("web")(web_command)


def _settings() -> Settings:
    return load_settings()


def _app(settings: Settings | None = None) -> Harvest:
    app = Harvest(settings or _settings())
    app.load_imports()
    return app


def _fmt_time(value: datetime | None) -> str:
    return value.isoformat(timespec="milliseconds") if value else "-"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _triple(values: tuple[float, float, float] | None) -> str:
    return " / ".join(_ms(v) for v in values) if values else "-"


# --- dev ------------------------------------------------------------------------------------


@dev_cli.command("up")
def dev_up() -> None:
    """Give harvest a Postgres and a Redis: the configured ones, the machine's, or private
    servers started in ./.harvest (recorded there for every other command)."""
    state = dev.up()
    table = Table("service", "url", "source", title="harvest dev")
    table.add_row("postgres", redact_url(state.database_url), state.database_source)
    table.add_row("redis", redact_url(state.redis_url), state.redis_source)
    out.print(table)


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
    table = Table("service", "url", "source", "pid", "answers")
    for s in status.services:
        table.add_row(
            s.service, s.url, s.source, str(s.pid or "-"), "yes" if s.answers else f"no: {s.detail}"
        )
    out.print(table)
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


# --- enqueue and jobs -----------------------------------------------------------------------


@cli.command("enqueue")
def enqueue(
    name: Annotated[str, typer.Argument(help="A job registered in HARVEST_IMPORTS.")],
    payload: Annotated[
        str, typer.Option(help="The handler's keyword arguments as a JSON object.")
    ] = "{}",
    delay: Annotated[float | None, typer.Option(help="Seconds before it is due.")] = None,
    priority: Annotated[int, typer.Option(help="-1000..1000, higher first.")] = 0,
    idempotency_key: Annotated[str | None, typer.Option(help="Enqueue once per key.")] = None,
) -> None:
    """Enqueue one job and print its id."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise InvalidPayload(
            f"--payload is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise InvalidPayload(f"--payload is nested deeper than {MAX_DEPTH} levels") from None
    app = _app()
    ref = app.enqueue(name, data, delay=delay, priority=priority, idempotency_key=idempotency_key)
    out.print(f"{ref.id}" if ref.created else f"{ref.id} (already enqueued with this key)")


@jobs_cli.command("ls")
def jobs_ls(
    status: Annotated[str | None, typer.Option(help="pending, running, failed, ...")] = None,
    name: Annotated[str | None, typer.Option(help="Only jobs of this name.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
) -> None:
    """List jobs, newest first."""
    app = _app()
    with app.engine.connect() as conn:
        rows = store.list_jobs(conn, status=status, name=name, limit=limit)
    table = Table("id", "name", "status", "attempts", "priority", "run at", "last error")
    for job in rows:
        table.add_row(
            str(job.id),
            job.name,
            job.status,
            f"{job.attempts}/{job.max_attempts}",
            str(job.priority),
            _fmt_time(job.run_at),
            (job.last_error or "")[:60],
        )
    out.print(table)


@jobs_cli.command("show")
def jobs_show(job_id: int) -> None:
    """Everything about one job: attempts, timings, result, last error with its traceback."""
    job = _app().get(job_id)
    out.print(_job_table(job))
    if job.last_traceback:
        out.print("[bold]last traceback[/bold]")
        out.print(job.last_traceback, markup=False)


def _job_table(job: Job) -> Table:
    table = Table(show_header=False, title=f"job {job.id}")
    rows: list[tuple[str, Any]] = [
        ("name", job.name),
        ("queue", job.queue),
        ("status", job.status),
        ("attempts", f"{job.attempts}/{job.max_attempts}"),
        ("priority", job.priority),
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


jobs_cli.command("retry")(retry_command)


# --- keys -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _key_services(settings: Settings) -> Iterator[tuple[Engine, redis.Redis]]:
    """A one-connection engine and a Redis client, closed after; driver errors become one
    clear line (ServiceUnavailable)."""
    engine = make_engine(settings, pool_size=1)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        with translate_errors():
            yield engine, client
    except redis.RedisError as exc:
        raise ServiceUnavailable("Redis", _first_line(exc)) from None
    finally:
        client.close()
        engine.dispose()


def _first_line(exc: BaseException) -> str:
    lines = redact_text(str(exc)).splitlines()
    return lines[0] if lines else type(exc).__name__


def _sync_pool(engine: Engine, client: redis.Redis, pool: str) -> None:
    """Bring the live pool in Redis in step with Postgres after a key change."""
    try:
        keystore.sync_pool(engine, client, pool)
    except redis.RedisError as exc:
        raise ServiceUnavailable(
            "Redis",
            f"{_first_line(exc)}; the change is saved in Postgres: "
            f"run `harvest keys sync {pool}` once Redis answers",
        ) from None


def _read_secret(secret_env: str | None, secret_stdin: bool) -> str:
    """The secret from the environment variable named, else stdin (never from argv)."""
    if secret_env is not None:
        if secret_stdin:
            raise InvalidKey("secret", "give --secret-stdin or --secret-env, not both")
        value = os.environ.get(secret_env)
        if value is None:
            raise InvalidKey("secret", f"environment variable {secret_env!r} is not set")
        return value.strip()
    if sys.stdin.isatty():
        return getpass.getpass("API key secret (not echoed): ").strip()
    value = sys.stdin.read(4 * keystore.MAX_SECRET_CHARS).strip()
    if not value:
        raise InvalidKey("secret", "nothing on stdin (pipe the secret in, or use --secret-env VAR)")
    return value


@keys_cli.command(
    "add", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def keys_add(
    ctx: typer.Context,
    pool: Annotated[str, typer.Argument(help="The pool's name.")],
    name: Annotated[str, typer.Argument(help="The key's name within the pool.")],
    *,
    max_concurrency: Annotated[
        int, typer.Option(help="Leases the key may have at once (1..10000).")
    ] = 1,
    rate: Annotated[
        str | None, typer.Option(help="Calls allowed per period: 60/m, 5/s, 1000/h, 10/2s.")
    ] = None,
    secret_stdin: Annotated[
        bool, typer.Option("--secret-stdin", help="Read the secret from stdin (the default).")
    ] = False,
    secret_env: Annotated[
        str | None,
        typer.Option("--secret-env", metavar="VAR", help="Read the secret from this variable."),
    ] = None,
) -> None:
    """Add an API key to POOL; its secret is read from stdin or --secret-env.

    The secret is never taken from the command line, and is stored encrypted with
    HARVEST_SECRET_KEY; only its masked form (sk-…abcd) is ever shown."""
    if ctx.args:  # never echo them: a secret typed on the command line would be printed
        raise InvalidKey(
            "secret", "never give it on the command line: pipe it on stdin or use --secret-env VAR"
        )
    settings = _settings()
    cipher = keystore.Cipher.from_settings(settings)
    if not cipher.has_key:
        raise ConfigurationError(keystore.NOT_SET)
    secret = _read_secret(secret_env, secret_stdin)
    with _key_services(settings) as (engine, client):
        with Session(engine) as session, session.begin():
            info, created = keystore.add_key(
                session, cipher, pool=pool, name=name, secret=secret,
                max_concurrency=max_concurrency, rate_limit=rate,
            )  # fmt: skip
        _sync_pool(engine, client, info.pool)
    where = f"{info.pool}/{info.name} (id {info.id}, {info.hint})"
    if created:
        out.print(f"added key {where}", markup=False)
    else:
        out.print(
            f"key {where} already exists: left unchanged (rm it first to replace it)",
            markup=False,
        )


@keys_cli.command("ls")
def keys_ls(pool: Annotated[str | None, typer.Argument(help="Only this pool.")] = None) -> None:
    """List API keys (secrets masked), with their live leases when the pool is loaded."""
    with _key_services(_settings()) as (engine, client):
        with engine.connect() as conn:
            rows = keystore.list_keys(conn, pool)
        live = {p: _live_state(client, p) for p in sorted({r.pool for r in rows})}
    if not rows:
        out.print(f"no keys in pool {pool!r}" if pool else "no keys", markup=False)
        return
    out.print(_keys_table(rows, live))


def _live_state(client: redis.Redis, pool: str) -> dict[int, KeyState] | None:
    """The pool's keys as Redis sees them now; None when the pool is not loaded."""
    try:
        return {s.key_id: s for s in KeyPool(client, pool).snapshot()}
    except PoolNotLoaded:
        return None


def _keys_table(rows: list[keystore.KeyInfo], live: dict[str, dict[int, KeyState] | None]) -> Table:
    table = Table(
        "pool", "name", "secret", "status", "max conc.", "rate", "leases", "use",
        "cooldown until", "last used", title="API keys",
    )  # fmt: skip
    for key in rows:
        states = live.get(key.pool)
        state = states.get(key.id) if states is not None else None
        table.add_row(
            key.pool, key.name, key.hint, _key_status(key, state), str(key.max_concurrency),
            key.rate_limit or "-", *_key_use(states, state), _key_cooldown(key, state),
            _fmt_time(key.last_used_at),
        )  # fmt: skip
    return table


def _key_status(key: keystore.KeyInfo, state: KeyState | None) -> str:
    if state is None or state.status == key.status:
        return key.status
    return f"{key.status} (live: {state.status})"


def _key_use(states: dict[int, KeyState] | None, state: KeyState | None) -> tuple[str, str]:
    if states is None:
        return "not loaded", "-"
    if state is None:
        return "not synced", "-"
    return f"{state.live_leases}/{state.max_concurrency}", (
        f"{state.live_leases / state.max_concurrency:.0%}"
    )


def _key_cooldown(key: keystore.KeyInfo, state: KeyState | None) -> str:
    until = key.cooldown_until
    if state is not None and state.cooldown_until is not None:
        live = datetime.fromtimestamp(state.cooldown_until, UTC)
        until = max(until, live) if until is not None else live
    return _fmt_time(until)


def _change_key(
    pool: str, name: str, change: Callable[[Connection, keystore.KeyRef], keystore.KeyInfo]
) -> keystore.KeyInfo:
    """Apply one key change in Postgres, commit, then sync the pool in Redis."""
    with _key_services(_settings()) as (engine, client):
        with engine.begin() as conn:
            info = change(conn, (pool, name))
        _sync_pool(engine, client, pool)
    return info


@keys_cli.command("disable")
def keys_disable(pool: str, name: str) -> None:
    """Stop leasing a key (leases held now run out)."""
    info = _change_key(pool, name, lambda c, k: keystore.set_status(c, k, "disabled"))
    out.print(f"key {info.pool}/{info.name}: disabled", markup=False)


@keys_cli.command("enable")
def keys_enable(pool: str, name: str) -> None:
    """Lease a key again (a cooldown running in Redis still holds)."""
    info = _change_key(pool, name, lambda c, k: keystore.set_status(c, k, "active"))
    out.print(f"key {info.pool}/{info.name}: active", markup=False)


@keys_cli.command("rm")
def keys_rm(pool: str, name: str) -> None:
    """Delete a key and its secret; leases held now are dropped."""
    info = _change_key(pool, name, keystore.remove_key)
    out.print(f"removed key {info.pool}/{info.name} (id {info.id}, {info.hint})", markup=False)


@keys_cli.command("sync")
def keys_sync(pool: str) -> None:
    """Copy POOL's keys from Postgres into Redis.

    Every key change does it; run it after an outage or a change made with SQL."""
    with _key_services(_settings()) as (engine, client):
        count = keystore.sync_pool(engine, client, pool)
    out.print(f"pool {pool}: {count} key(s) loaded", markup=False)


# --- stats, top, metrics -------------------------------------------------------------------


@contextlib.contextmanager
def _figure_services() -> Iterator[tuple[Engine, redis.Redis]]:
    """A small engine and a Redis client for reading figures, closed after."""
    settings = _settings()
    engine = make_engine(settings, pool_size=2)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        yield engine, client
    finally:
        client.close()
        engine.dispose()


def _pools_or_note(engine: Engine, client: redis.Redis) -> list[stats.PoolUse] | str:
    """Every key pool's utilisation; when Redis does not answer, a note saying so (the
    Postgres figures are still worth showing)."""
    try:
        return stats.key_pools(engine, client)
    except ServiceUnavailable as exc:
        if exc.service != "Redis":
            raise
        return str(exc)


def _stats_table(figures: stats.Stats, pools: list[stats.PoolUse] | str) -> Table:
    """The one table of `harvest stats` and `harvest top`."""
    table = Table("figure", "value", title="harvest stats")
    for queue, status, n in sorted(figures.depth):
        table.add_row(f"depth {queue} / {status}", str(n))
    if not figures.depth:
        table.add_row("depth", "no jobs")
    table.add_section()
    w = figures.last_minute
    table.add_row("throughput (last minute)", f"{figures.throughput:.1f} jobs/s")
    table.add_row("succeeded / failed / cancelled", f"{w.succeeded} / {w.failed} / {w.cancelled}")
    table.add_row("retried (2+ attempts)", str(w.retried))
    table.add_row("enqueue-to-start p50/p95/p99", _triple(w.wait_p))
    table.add_row("run time p50/p95/p99", _triple(w.run_p))
    table.add_section()
    for key in stats.COUNTERS:
        table.add_row(key.replace("_", " "), str(figures.counters.get(key, 0)))
    table.add_section()
    _pool_rows(table, pools)
    return table


def _pool_rows(table: Table, pools: list[stats.PoolUse] | str) -> None:
    if isinstance(pools, str):
        table.add_row("key pools", pools)
        return
    if not pools:
        table.add_row("key pools", "none")
    for pool in pools:
        table.add_row(
            f"key pool {pool.pool}: keys active / cooling / disabled",
            f"{pool.count('active')} / {pool.count('cooling')} / {pool.count('disabled')}",
        )
        if not pool.loaded:
            use = "not loaded in Redis (`harvest keys sync`)"
        else:
            ratio = pool.utilisation
            use = f"{pool.leases} / {pool.capacity}" + (
                f" ({ratio:.0%})" if ratio is not None else ""
            )
        table.add_row(f"key pool {pool.pool}: leases / capacity", use)


@cli.command("stats")
def stats_cmd() -> None:
    """Depth, throughput, latencies, failures, rescues, duplicates, key pool use.

    One table: depth by queue and status; the last minute's throughput, outcomes and
    latencies (enqueue-to-start and run time p50/p95/p99); rescues, duplicate deliveries
    suppressed, lost outcomes; key pool utilisation (keys active / cooling / disabled, leases
    held / capacity)."""
    with _figure_services() as (engine, client):
        figures = stats.collect(engine)
        pools = _pools_or_note(engine, client)
    out.print(_stats_table(figures, pools))


@cli.command("top")
def top_cmd(
    interval: Annotated[
        float, typer.Option(min=0.1, max=3600, help="Seconds between refreshes.")
    ] = 2.0,
    iterations: Annotated[
        int, typer.Option(min=0, help="Stop after this many refreshes (0: until Ctrl-C).")
    ] = 0,
) -> None:
    """The `harvest stats` table, live (Ctrl-C to leave)."""
    with _figure_services() as (engine, client):

        def view() -> Table:
            table = _stats_table(stats.collect(engine), _pools_or_note(engine, client))
            table.caption = f"{datetime.now(UTC):%H:%M:%S} UTC, every {interval:g}s (Ctrl-C quits)"
            return table

        try:
            if out.is_terminal:
                with Live(view(), console=out, auto_refresh=False) as live:
                    for _ in _ticks(interval, iterations):
                        live.update(view(), refresh=True)
            else:  # a file or a pipe: one table per refresh, like a log
                out.print(view())
                for _ in _ticks(interval, iterations):
                    out.print(view())
        except KeyboardInterrupt:
            pass


def _ticks(interval: float, iterations: int) -> Iterator[int]:
    """Yield after each ``interval`` until ``iterations`` views were shown in all (the first
    is shown before the loop); forever when ``iterations`` is 0."""
    shown = 1
    while not iterations or shown < iterations:
        time.sleep(interval)
        shown += 1
        yield shown


@cli.command("metrics")
def metrics_cmd(
    host: Annotated[
        str, typer.Option(help="Address to listen on (keep it on loopback or a private network).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 9808,
) -> None:
    """Serve Prometheus metrics on loopback (default port 9808).

    The figures of `harvest stats`, jobs by name and status, and key pool gauges, computed on
    each scrape from Postgres and Redis. SIGTERM or Ctrl-C stops it."""
    from harvest import metrics

    with _figure_services() as (engine, client):
        server = metrics.make_server(engine, client, host=host, port=port)

        def stop(signum: int, frame: object) -> None:
            threading.Thread(target=server.shutdown, daemon=True).start()

        previous = signal.signal(signal.SIGTERM, stop)
        out.print(f"serving metrics on http://{host}:{server.server_port}/metrics", markup=False)
        try:
            server.serve_forever(poll_interval=0.5)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            server.server_close()


# --- demo -----------------------------------------------------------------------------------


@cli.command("demo")
def demo_cmd(
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000, help="How many jobs.")] = 3000,
    concurrency: Annotated[int, typer.Option(min=1, max=64, help="Execution processes.")] = 6,
    timeout: Annotated[float, typer.Option(help="Give up waiting after this many seconds.")] = 600,
) -> None:
    """Run harvest end to end against a local rate-limited API, with a summary.

    Services, migrations, a local API on loopback with per-key limits (429 + Retry-After,
    some 500s), a pool of demo keys, workers and beat, N "harvest a page" jobs with a live
    progress bar; then it stops everything it started."""
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
            on_enqueued=lambda n: bar.update(enq, completed=n),
            on_progress=progress,
        )
    out.print(_demo_summary(result))
    out.print(_demo_keys(result))
    if result.unfinished:
        raise typer.Exit(1)


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


def _demo_keys(result: DemoResult) -> Table:
    table = Table(
        "key", "max conc.", "declared rate", "the API allows", "200s", "429s", "500s",
        title=f"keys of pool {result.pool!r} (secrets made up for the run, never shown)",
    )  # fmt: skip
    for k in result.keys:
        table.add_row(
            k.name, str(k.max_concurrency), k.rate or "not declared", k.api_limit,
            str(k.ok), str(k.http_429), str(k.http_500),
        )  # fmt: skip
    return table


@contextlib.contextmanager
def _boundary() -> Iterator[None]:
    """Driver errors that escaped a command become one clear line (HarvestError)."""
    from alembic.util import CommandError

    try:
        with translate_errors():
            yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise ServiceUnavailable("Redis", _first_line(exc)) from None
    except ProgrammingError as exc:
        if getattr(exc.orig, "sqlstate", None) == "42P01":  # undefined_table
            raise HarvestError(
                "the database has no harvest tables: run `harvest db upgrade` first"
            ) from None
        raise
    except CommandError as exc:
        raise HarvestError(f"migration: {_first_line(exc)}") from None
    except ValidationError as exc:  # the settings, read from HARVEST_* variables
        raise ConfigurationError(_bad_settings(exc)) from None


def _bad_settings(exc: ValidationError) -> str:
    """Which variables are wrong and why; never their values (one may be a secret)."""
    problems = "; ".join(
        f"HARVEST_{str(e['loc'][0]).upper() if e['loc'] else exc.title}: "
        f"{str(e['msg']).removeprefix('Value error, ')}"
        for e in exc.errors(include_input=False, include_url=False)
    )
    return f"bad configuration: {problems}"


# Typer >= 0.20 vendors Click (typer._click): its exceptions are not click's. Catch both.
_EXITS = tuple({click.exceptions.Exit, typer.Exit})
_ABORTS = tuple({click.exceptions.Abort, typer.Abort})
_USAGE = tuple({click.ClickException, getattr(typer, "TyperException", click.ClickException)})


def main() -> None:
    command = typer.main.get_command(cli)
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
