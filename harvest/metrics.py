"""Prometheus metrics: the figures of ``harvest stats``, computed on each scrape.

Nothing is counted in memory: every scrape reads Postgres (the jobs table, ``harvest_counters``,
``harvest_api_keys``, the usage totals of :mod:`harvest.usage`) and Redis (the live state of
every key pool), so the values survive a restart of the metrics process and agree whichever
process serves them. Outcomes per job name are rows of the jobs table by name and status (a
gauge: nothing is written on the hot path to count them, and retention may delete rows); the
counters of ``harvest_counters`` and the usage totals only grow and are Prometheus counters.

``harvest metrics`` serves :func:`make_server` (loopback by default). :data:`SERIES` names and
documents every series; a scrape that cannot reach Postgres or Redis still answers, with
``harvest_up{service=...} 0`` and without the series that service provides.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.simple_server import make_server as _make_wsgi_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from harvest import stats
from harvest.db import unavailable
from harvest.errors import HarvestError, ServiceUnavailable
from harvest.usage import rows as usage_rows

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9808
QUANTILES = ("0.5", "0.95", "0.99")
KEY_STATUSES = ("active", "cooling", "disabled")


@dataclass(frozen=True, slots=True)
class Series:
    """One documented series: its name as exposed, its type, labels and meaning."""

    name: str
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    help: str


def _g(name: str, labels: tuple[str, ...], help_: str) -> Series:
    return Series(name, "gauge", labels, help_)


SERIES: tuple[Series, ...] = (
    _g(
        "harvest_jobs",
        ("queue", "status"),
        "Jobs by queue and status (depth; ended ones until retention).",
    ),
    _g(
        "harvest_jobs_by_name",
        ("name", "status"),
        "Jobs by job name and status; succeeded/failed/cancelled are outcomes so far "
        "(rows of the jobs table: a gauge, retention may delete rows).",
    ),
    _g(
        "harvest_jobs_finished_last_minute",
        ("outcome",),
        "Jobs that ended in the last 60 s, by outcome (succeeded, failed, cancelled).",
    ),
    _g("harvest_jobs_retried_last_minute", (), "Jobs ended in the last 60 s after 2+ attempts."),
    _g("harvest_throughput_jobs_per_second", (), "Jobs ended per second over the last 60 s."),
    _g(
        "harvest_enqueue_to_start_seconds",
        ("quantile",),
        "Due-to-start latency of first attempts that ended in the last 60 s (p50/p95/p99).",
    ),
    _g(
        "harvest_run_seconds",
        ("quantile",),
        "Run time of attempts that succeeded in the last 60 s (p50/p95/p99).",
    ),
    Series("harvest_rescued_total", "counter", (), "Expired leases taken back by rescue (jobs)."),
    Series(
        "harvest_duplicate_deliveries_suppressed_total",
        "counter",
        (),
        "Deliveries refused because their lease token was stale or the job already started.",
    ),
    Series(
        "harvest_lost_outcomes_dropped_total",
        "counter",
        (),
        "Outcomes of attempts that had lost their lease, dropped (a newer attempt owns the job).",
    ),
    Series(
        "harvest_malformed_messages_dropped_total",
        "counter",
        (),
        "Execution messages that were not [[job_id, token], ...], dropped.",
    ),
    _g("harvest_key_pool_keys", ("pool", "status"), "API keys of a pool by live status."),
    _g("harvest_key_pool_leases", ("pool",), "Key leases held now in a pool."),
    _g(
        "harvest_key_pool_capacity",
        ("pool",),
        "Leases a pool allows at once: max_concurrency summed over keys not disabled.",
    ),
    _g(
        "harvest_key_pool_utilisation",
        ("pool",),
        "Leases held / capacity (absent when the capacity is 0).",
    ),
    _g(
        "harvest_key_pool_loaded",
        ("pool",),
        "1 when Redis holds the pool's live state, 0 when it was never synced or was lost.",
    ),
    _g("harvest_key_leases", ("pool", "key"), "Leases held now on one key."),
    _g("harvest_key_max_concurrency", ("pool", "key"), "Most leases one key may have at once."),
    _g(
        "harvest_key_rate_used",
        ("pool", "key"),
        "Calls admitted in the key's current rate window (keys with a rate limit).",
    ),
    _g(
        "harvest_key_rate_limit",
        ("pool", "key"),
        "Calls a key may make per rate window, as harvest enforces it (keys with a rate limit).",
    ),
    _g(
        "harvest_key_effective_concurrency",
        ("pool", "key"),
        "Leases one key is admitted at once now: max_concurrency, or lower after 429s with room.",
    ),
    _g(
        "harvest_key_effective_rate",
        ("pool", "key"),
        "Calls a rate window admits now: the declared rate, or lower after 429s with room.",
    ),
    _g(
        "harvest_key_limit_lowered",
        ("pool", "key"),
        "Times a 429 with room under its declared limits lowered a key's effective limits.",
    ),
    _g(
        "harvest_key_status",
        ("pool", "key", "status"),
        "1 for the key's live status (active, cooling, disabled), 0 for the others.",
    ),
    Series(
        "harvest_key_requests_total",
        "counter",
        ("pool", "key"),
        "Calls made with a key (a handler that ran holding it), as written by the workers' usage "
        "flushes (every HARVEST_USAGE_FLUSH_INTERVAL s). Sum by pool for a pool's.",
    ),
    Series(
        "harvest_key_tokens_total",
        "counter",
        ("pool", "key"),
        "Tokens used with a key: what handlers reported (ctx.used), else the tokens reserved.",
    ),
    Series(
        "harvest_key_rate_limited_total",
        "counter",
        ("pool", "key"),
        "Calls with a key that the service answered 429 (the handler raised RateLimited).",
    ),
    Series(
        "harvest_tenant_requests_total",
        "counter",
        ("pool", "tenant"),
        "Calls made with a pool's keys for jobs of a tenant (enqueue(..., tenant=); '' for jobs "
        "without one), from the same usage flushes.",
    ),
    Series(
        "harvest_tenant_tokens_total",
        "counter",
        ("pool", "tenant"),
        "Tokens used for a tenant's jobs with a pool's keys.",
    ),
    Series(
        "harvest_tenant_rate_limited_total",
        "counter",
        ("pool", "tenant"),
        "Calls for a tenant's jobs that the service answered 429.",
    ),
    Series(
        "harvest_tenant_errors_total",
        "counter",
        ("pool", "tenant"),
        "Calls for a tenant's jobs whose attempt ended in another error.",
    ),
    Series(
        "harvest_key_errors_total",
        "counter",
        ("pool", "key"),
        "Calls with a key whose attempt ended in another error (timeouts included).",
    ),
    _g("harvest_up", ("service",), "1 when the service (postgres, redis) answered this scrape."),
    _g("harvest_scrape_duration_seconds", (), "Seconds this scrape took to compute."),
)

_BY_NAME = {s.name: s for s in SERIES}


def _family(name: str) -> Any:
    """An empty metric family of a series of :data:`SERIES` (its help and labels)."""
    series = _BY_NAME[name]
    if series.kind == "counter":
        return CounterMetricFamily(
            name.removesuffix("_total"), series.help, labels=list(series.labels)
        )
    return GaugeMetricFamily(name, series.help, labels=list(series.labels))


class HarvestCollector(Collector):
    """Computes every series of :data:`SERIES` on each scrape (one scrape at a time)."""

    def __init__(self, engine: Engine, redis: Redis) -> None:
        """
        :param engine: the harvest database (a small pool is enough: scrapes are serialised).
        :param redis: the coordination Redis client.
        """
        self.engine = engine
        self.redis = redis
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        return []  # nothing to compute at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            started = time.monotonic()
            up = _family("harvest_up")
            families, pg_ok = self._jobs()
            yield from families
            pools, redis_ok = self._pools(pg_ok)
            yield from pools
            up.add_metric(["postgres"], 1.0 if pg_ok else 0.0)
            up.add_metric(["redis"], 1.0 if redis_ok else 0.0)
            yield up
            duration = _family("harvest_scrape_duration_seconds")
            duration.add_metric([], time.monotonic() - started)
            yield duration

    # --- Postgres -------------------------------------------------------------------------------

    def _jobs(self) -> tuple[list[Metric], bool]:
        try:
            figures = stats.collect(self.engine)
            by_name = stats.jobs_by_name(self.engine)
            usage = _usage_families(self.engine)
        except ServiceUnavailable:
            return [], False
        families = [*_job_families(figures, by_name), *_counter_families(figures.counters)]
        return [*families, *usage], True

    # --- Redis ----------------------------------------------------------------------------------

    def _pools(self, pg_ok: bool) -> tuple[list[Metric], bool]:
        try:
            self.redis.ping()
        except RedisError:
            return [], False
        if not pg_ok:
            return [], True  # key names and limits live in Postgres
        try:
            pools = stats.key_pools(self.engine, self.redis)
        except ServiceUnavailable as exc:
            return [], exc.service != "Redis"
        return _pool_families(pools), True


def _job_families(figures: stats.Stats, by_name: list[tuple[str, str, int]]) -> Iterator[Metric]:
    depth = _family("harvest_jobs")
    for queue, status, n in sorted(figures.depth):
        depth.add_metric([queue, status], n)
    yield depth
    named = _family("harvest_jobs_by_name")
    for name, status, n in sorted(by_name):
        named.add_metric([name, status], n)
    yield named
    w = figures.last_minute
    finished = _family("harvest_jobs_finished_last_minute")
    for outcome, n in (
        ("succeeded", w.succeeded),
        ("failed", w.failed),
        ("cancelled", w.cancelled),
    ):
        finished.add_metric([outcome], n)
    yield finished
    retried = _family("harvest_jobs_retried_last_minute")
    retried.add_metric([], w.retried)
    yield retried
    throughput = _family("harvest_throughput_jobs_per_second")
    throughput.add_metric([], figures.throughput)
    yield throughput
    for name, values in (
        ("harvest_enqueue_to_start_seconds", w.wait_p),
        ("harvest_run_seconds", w.run_p),
    ):
        family = _family(name)
        for quantile, value in zip(QUANTILES, values or (), strict=False):
            family.add_metric([quantile], value)
        yield family


def _counter_families(counters: dict[str, int]) -> Iterator[Metric]:
    for key in stats.COUNTERS:
        family = _family(f"harvest_{key}_total")
        family.add_metric([], counters.get(key, 0))
        yield family


USAGE = {
    "harvest_key_requests_total": "requests",
    "harvest_key_tokens_total": "tokens",
    "harvest_key_rate_limited_total": "rate_limited",
    "harvest_key_errors_total": "errors",
}


def _usage_families(engine: Engine) -> list[Metric]:
    """The usage counters, from the running totals (they only grow: retention prunes minutes,
    never totals, so a counter never goes back)."""
    try:
        with engine.connect() as conn:
            keys = usage_rows.per_key(conn, minutes=None)
            tenants = usage_rows.per_tenant(conn, minutes=None)
    except (OperationalError, InterfaceError) as exc:
        raise unavailable(exc) from None
    families = {name: _family(name) for name in USAGE}
    for one in keys:
        for name, field in USAGE.items():
            families[name].add_metric([one.pool, one.key or ""], getattr(one, field))
    by_tenant = {name.replace("_key_", "_tenant_"): field for name, field in USAGE.items()}
    tenant_families = {name: _family(name) for name in by_tenant}
    for one in tenants:
        for name, field in by_tenant.items():
            tenant_families[name].add_metric([one.pool, one.tenant or ""], getattr(one, field))
    return [*families.values(), *tenant_families.values()]


def _pool_families(pools: list[stats.PoolUse]) -> list[Metric]:
    names = (
        "harvest_key_pool_keys", "harvest_key_pool_leases", "harvest_key_pool_capacity",
        "harvest_key_pool_utilisation", "harvest_key_pool_loaded", "harvest_key_leases",
        "harvest_key_max_concurrency", "harvest_key_rate_used", "harvest_key_rate_limit",
        "harvest_key_status", "harvest_key_effective_concurrency", "harvest_key_effective_rate",
        "harvest_key_limit_lowered",
    )  # fmt: skip
    f = {name: _family(name) for name in names}
    for pool in pools:
        for status in KEY_STATUSES:
            f["harvest_key_pool_keys"].add_metric([pool.pool, status], pool.count(status))
        f["harvest_key_pool_leases"].add_metric([pool.pool], pool.leases)
        f["harvest_key_pool_capacity"].add_metric([pool.pool], pool.capacity)
        if pool.utilisation is not None:
            f["harvest_key_pool_utilisation"].add_metric([pool.pool], pool.utilisation)
        f["harvest_key_pool_loaded"].add_metric([pool.pool], 1.0 if pool.loaded else 0.0)
        for key in pool.keys:
            labels = [pool.pool, key.name]
            f["harvest_key_leases"].add_metric(labels, key.live.live_leases if key.live else 0)
            f["harvest_key_max_concurrency"].add_metric(labels, key.max_concurrency)
            if key.live is not None and key.live.rate is not None:
                f["harvest_key_rate_used"].add_metric(labels, key.live.rate_used)
                f["harvest_key_rate_limit"].add_metric(labels, key.live.rate.count)
                f["harvest_key_effective_rate"].add_metric(labels, key.live.effective_rate)
            if key.live is not None:
                live = key.live
                f["harvest_key_effective_concurrency"].add_metric(labels, live.effective_max)
                f["harvest_key_limit_lowered"].add_metric(labels, live.lowered)
            for status in KEY_STATUSES:
                f["harvest_key_status"].add_metric(
                    [*labels, status], 1.0 if key.status == status else 0.0
                )
    return list(f.values())


# --- serving ------------------------------------------------------------------------------------


def registry_for(engine: Engine, redis: Redis) -> CollectorRegistry:
    """A registry holding only harvest's collector (no process metrics of the server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HarvestCollector(engine, redis))
    return registry


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # the CLI is the only place that prints


def make_server(engine: Engine, redis: Redis, *, host: str, port: int) -> WSGIServer:
    """An HTTP server answering every path with the metrics (Prometheus text format).
    Call ``serve_forever()`` on it; ``shutdown()`` from another thread stops it.

    :param host: the address to bind (keep it on loopback or a private interface).
    :param port: the TCP port (0: any free port; read ``server_port`` after).
    :raises HarvestError: the address cannot be bound.
    """
    app = make_wsgi_app(registry_for(engine, redis))
    try:
        return _make_wsgi_server(host, port, app, _Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise HarvestError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
