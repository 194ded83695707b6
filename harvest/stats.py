"""The figures people look at (``harvest stats``, ``top``, the demo summary, metrics).

Job figures are computed from Postgres (the jobs table and ``harvest_counters``), key pool
figures from Redis (live leases, cooldowns) joined with Postgres (key names, limits): so they
survive restarts and agree across processes. Nothing here keeps state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import Engine, text

from harvest import keystore, store
from harvest.coordination.key_pool import KeyPool, KeyState
from harvest.db import translate_errors
from harvest.errors import PoolNotLoaded, ServiceUnavailable
from harvest.redact import redact_text
from harvest.store import Window

COUNTERS = (
    "rescued",
    "duplicate_deliveries_suppressed",
    "lost_outcomes_dropped",
    "malformed_messages_dropped",
)
"""The counters of ``harvest_counters`` (they only grow)."""


@dataclass(frozen=True, slots=True)
class Stats:
    depth: list[tuple[str, str, int]]  # (queue, status, jobs)
    last_minute: Window
    counters: dict[str, int]

    @property
    def throughput(self) -> float:
        """Jobs that ended per second over the last minute."""
        w = self.last_minute
        return (w.succeeded + w.failed + w.cancelled) / 60.0


def collect(engine: Engine) -> Stats:
    with translate_errors(), engine.connect() as conn:
        return Stats(
            depth=store.depth(conn),
            last_minute=store.window(conn, seconds=60),
            counters=store.counters(conn),
        )


def summarize(engine: Engine, ids: Sequence[int], *, since_seconds: float = 86400) -> Window:
    with translate_errors(), engine.connect() as conn:
        return store.window(conn, seconds=since_seconds, ids=ids)


# --- jobs by name ---------------------------------------------------------------------------

_BY_NAME = text("SELECT name, status, count(*) AS n FROM harvest_jobs_all GROUP BY name, status")


def jobs_by_name(engine: Engine) -> list[tuple[str, str, int]]:
    """Rows of the jobs table by (name, status): every job's outcome so far, per job name."""
    with translate_errors(), engine.connect() as conn:
        return [(r.name, r.status, int(r.n)) for r in conn.execute(_BY_NAME)]


# --- key pools ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyUse:
    """One API key: its name and limits from Postgres, its live state from Redis (None when
    the pool is not loaded in Redis or the key not synced yet). Never its secret."""

    pool: str
    name: str
    key_id: int
    status: str  # live status when known, else the one in Postgres
    max_concurrency: int
    rate_limit: str | None
    live: KeyState | None


@dataclass(frozen=True, slots=True)
class PoolUse:
    """An API key pool's utilisation: how many keys are usable, and how many leases are held
    out of the pool's capacity (the max_concurrency of its keys that are not disabled: a
    cooling key comes back by itself)."""

    pool: str
    keys: tuple[KeyUse, ...]
    loaded: bool  # False: Redis holds no state for the pool (never synced, or lost)

    def count(self, status: str) -> int:
        return sum(1 for k in self.keys if k.status == status)

    @property
    def leases(self) -> int:
        return sum(k.live.live_leases for k in self.keys if k.live is not None)

    @property
    def capacity(self) -> int:
        return sum(k.max_concurrency for k in self.keys if k.status != "disabled")

    @property
    def utilisation(self) -> float | None:
        """Leases held / capacity; None when nothing can be leased."""
        return self.leases / self.capacity if self.capacity else None


def key_pools(engine: Engine, client: Redis, pools: Sequence[str] | None = None) -> list[PoolUse]:
    """Every pool of ``harvest_api_keys`` (or only ``pools``), with each key's live state.

    :raises ServiceUnavailable: Postgres or Redis did not answer.
    """
    with translate_errors(), engine.connect() as conn:
        infos = keystore.list_keys(conn)
    by_pool: dict[str, list[keystore.KeyInfo]] = {}
    for info in infos:
        if pools is None or info.pool in pools:
            by_pool.setdefault(info.pool, []).append(info)
    try:
        return [_pool_use(client, pool, rows) for pool, rows in sorted(by_pool.items())]
    except RedisError as exc:
        lines = redact_text(str(exc)).splitlines()
        raise ServiceUnavailable("Redis", lines[0] if lines else type(exc).__name__) from None


def _pool_use(client: Redis, pool: str, rows: list[keystore.KeyInfo]) -> PoolUse:
    try:
        live: dict[int, KeyState] | None = {s.key_id: s for s in KeyPool(client, pool).snapshot()}
    except PoolNotLoaded:
        live = None
    keys = []
    for info in rows:
        state = live.get(info.id) if live is not None else None
        keys.append(
            KeyUse(
                pool=pool,
                name=info.name,
                key_id=info.id,
                status=state.status if state is not None else info.status,
                max_concurrency=info.max_concurrency,
                rate_limit=info.rate_limit,
                live=state,
            )
        )
    return PoolUse(pool, tuple(keys), loaded=live is not None)
