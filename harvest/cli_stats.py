"""``harvest stats``, ``workers``, ``top`` and ``metrics``: the figures, from Postgres and
Redis. Registered in :mod:`harvest.cli`."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from harvest.cli_common import _Lazy, _settings, _triple, out
from harvest.errors import ServiceUnavailable

if TYPE_CHECKING:
    import redis
    from sqlalchemy import Engine

    from harvest import stats
else:
    redis = _Lazy("redis")
    stats = _Lazy("harvest.stats")

# --- stats, top, metrics -------------------------------------------------------------------


@contextlib.contextmanager
def _figure_services() -> Iterator[tuple[Engine, redis.Redis]]:
    """A small engine and a Redis client for reading figures, closed after."""
    from harvest.db import make_engine

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


def workers_cmd() -> None:
    """Live execution processes (from their heartbeats in Redis) and the jobs each holds now."""
    from harvest.processes import processes

    with _figure_services() as (engine, client):
        found = processes(engine, client)
    if not found:
        out.print("no execution process is alive")
        return
    table = Table("process", "pool", "queues", "slots (sync+async)", "held now", "jobs", "seen")
    for p in found:
        names = ", ".join(f"{j.name}#{j.id}" for j in p.jobs[:5])
        more = f" (+{len(p.jobs) - 5})" if len(p.jobs) > 5 else ""
        table.add_row(
            p.info.id, p.info.pool, ",".join(p.info.queues),
            f"{p.info.concurrency}+{p.info.async_concurrency}", str(p.info.in_flight),
            names + more, f"{p.seen_ago:.1f}s ago",
        )  # fmt: skip
    out.print(table)


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
                from rich.live import Live

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
