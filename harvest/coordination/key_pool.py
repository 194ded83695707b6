"""The Redis side of an API-key pool: who holds which key, and how fast each key is used.

Keys and their secrets live in Postgres; :meth:`KeyPool.sync` copies each key's limits and
status into Redis. A lease is taken in one Lua script that purges expired leases, skips keys that
are disabled, cooling down, at their concurrency or at their rate limit, and takes the lease and
one rate permit together. Leases expire on the Redis clock, so a dead holder's key comes back by
itself within its TTL; no sweeper is needed for correctness.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from redis import Redis

from harvest.coordination import keys
from harvest.coordination.rate_limit import Rate
from harvest.coordination.scripts import LuaScript, micros, text
from harvest.coordination.scripts import seconds as to_seconds
from harvest.errors import NoKeyAvailable, PoolNotLoaded

Status = Literal["active", "cooling", "disabled"]
STATUSES: tuple[str, ...] = get_args(Status)
MAX_BATCH = 1000
IDLE_RETRY = 1.0  # retry hint when no key can free up by time alone (none, or all disabled)
_POLL_MAX = 0.25


@dataclass(frozen=True)
class KeySpec:
    """One key's limits and status, as Postgres knows them."""

    key_id: int
    max_concurrency: int
    rate: Rate | None = None
    status: Status = "active"
    cooldown_until: float | None = None  # seconds since the epoch

    def __post_init__(self) -> None:
        if isinstance(self.key_id, bool) or not isinstance(self.key_id, int) or self.key_id < 0:
            raise ValueError(f"invalid key_id {self.key_id!r}: must be an integer >= 0")
        mc = self.max_concurrency
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
            raise ValueError(f"key {self.key_id}: invalid max_concurrency {mc!r}: must be >= 1")
        if self.status not in STATUSES:
            raise ValueError(f"key {self.key_id}: invalid status {self.status!r}: use {STATUSES}")
        if self.status == "cooling" and self.cooldown_until is None:
            raise ValueError(f"key {self.key_id}: status 'cooling' needs cooldown_until")
        if self.rate is not None and not isinstance(self.rate, Rate):
            raise ValueError(f"key {self.key_id}: invalid rate {self.rate!r}: use parse_rate()")

    def as_args(self) -> list[str | int]:
        """The six values ``pool_sync.lua`` takes per key."""
        rate = self.rate
        cool = micros(self.cooldown_until) if self.cooldown_until is not None else 0
        return [
            str(self.key_id),
            self.max_concurrency,
            rate.count if rate else 0,
            rate.period_micros if rate else 0,
            self.status,
            cool,
        ]


@dataclass(frozen=True)
class Lease:
    """A key held by one holder until ``expires_at`` (seconds since the epoch, Redis clock)."""

    pool: str
    key_id: int
    token: str
    fence: int
    expires_at: float


@dataclass(frozen=True)
class Busy:
    """No key could be leased now; one could be in about ``retry_after`` seconds."""

    retry_after: float


@dataclass(frozen=True)
class KeyState:
    """One key as Redis sees it right now (for the CLI and metrics)."""

    key_id: int
    status: Status
    live_leases: int
    max_concurrency: int
    cooldown_until: float | None
    rate: Rate | None
    rate_used: int

    @property
    def available(self) -> int:
        """Leases this key could grant right now: min(free concurrency, rate permits left)."""
        if self.status != "active":
            return 0
        free = self.max_concurrency - self.live_leases
        if self.rate is not None:
            free = min(free, self.rate.count - self.rate_used)
        return max(free, 0)

    @classmethod
    def from_reply(cls, row: Sequence[Any]) -> KeyState:
        key_id, status, live, mc, cool, rate_n, rate_us, used = row
        rate = Rate(int(rate_n), to_seconds(int(rate_us))) if int(rate_n) > 0 else None
        cooldown = to_seconds(int(cool)) if int(cool) else None
        return cls(int(key_id), _status(status), int(live), int(mc), cooldown, rate, int(used))


class KeyPool:
    """The live state of one named pool of API keys, shared by every worker through Redis."""

    def __init__(self, redis: Redis, pool: str) -> None:
        """
        :param redis: the coordination Redis client.
        :param pool: the pool's name (letters, digits and ``_.:/@=+-``).
        """
        self.pool = keys.check_name("pool", pool)
        self._prefix = keys.pool_prefix(pool)
        self._epoch = keys.pool_epoch(pool)
        self._members = keys.pool_members(pool)
        self._redis = redis
        self._sync = LuaScript(redis, "pool_sync")
        self._lease = LuaScript(redis, "pool_lease")
        self._heartbeat = LuaScript(redis, "pool_heartbeat")
        self._release = LuaScript(redis, "pool_release")
        self._admin = LuaScript(redis, "pool_key_admin")
        self._state = LuaScript(redis, "pool_state")

    # --- loading ------------------------------------------------------------------------------

    def sync(self, specs: Sequence[KeySpec]) -> None:
        """Make the pool hold exactly ``specs``; live leases of kept keys survive.

        Keys not listed are removed with their leases. A cooldown running in Redis is never
        shortened by a sync (a fresh 429 outlives a stale copy of the key's status).
        """
        args: list[str | int] = [self._prefix]
        seen: set[int] = set()
        for spec in specs:
            if not isinstance(spec, KeySpec):
                raise ValueError(f"pool {self.pool!r}: sync takes KeySpec values, got {spec!r}")
            if spec.key_id in seen:
                raise ValueError(f"pool {self.pool!r}: key_id {spec.key_id} is listed twice")
            seen.add(spec.key_id)
            args.extend(spec.as_args())
        self._sync.integer([self._epoch, self._members], args)

    def epoch(self) -> int | None:
        """The pool's sync counter; None when Redis holds no pool (never synced, or lost)."""
        value = self._redis.get(self._epoch)
        return None if value is None else int(value)

    def is_loaded(self) -> bool:
        """False when Redis lost the pool (restart, flush): call :meth:`sync` again."""
        return self.epoch() is not None

    # --- leasing ------------------------------------------------------------------------------

    def lease(self, holder: str, ttl: float) -> Lease | Busy:
        """Lease the least loaded usable key now, or say how long to wait.

        :param holder: who holds it (part of the token, for debugging).
        :param ttl: seconds until the lease expires unless heartbeated.
        :raises PoolNotLoaded: Redis holds no state for this pool.
        """
        result = self.lease_many(holder, ttl, 1)
        return result if isinstance(result, Busy) else result[0]

    def lease_many(self, holder: str, ttl: float, n: int) -> list[Lease] | Busy:
        """Lease up to ``n`` keys (spread over keys, least loaded first) in one script.

        Returns the leases granted (maybe fewer than ``n``), or :class:`Busy` when none was.
        """
        _check_ttl(ttl)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BATCH:
            raise ValueError(f"invalid lease count {n!r}: must be 1..{MAX_BATCH}")
        tokens = [f"{secrets.token_hex(8)}:{holder}" for _ in range(n)]
        reply = self._lease.array(
            [self._epoch, self._members, keys.pool_cursor(self.pool), keys.pool_fence(self.pool)],
            [self._prefix, micros(ttl), *tokens],
        )
        return self._leases_from(reply, tokens)

    def _leases_from(self, reply: list[Any], tokens: list[str]) -> list[Lease] | Busy:
        granted = int(reply[0])
        if granted < 0:
            raise PoolNotLoaded(self.pool)
        if granted == 0:
            retry_us = int(reply[1])
            return Busy(IDLE_RETRY if retry_us < 0 else to_seconds(retry_us))
        rows = reply[2:]
        return [
            Lease(
                self.pool,
                int(rows[i * 3]),
                tokens[i],
                int(rows[i * 3 + 1]),
                to_seconds(int(rows[i * 3 + 2])),
            )
            for i in range(granted)
        ]

    def acquire(self, holder: str, ttl: float, *, timeout: float) -> Lease:
        """Lease a key, waiting up to ``timeout`` seconds.

        :raises NoKeyAvailable: no key was free in time (carries the pool's retry estimate).
        """
        deadline = time.monotonic() + timeout
        while isinstance(result := self.lease(holder, ttl), Busy):
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoKeyAvailable(self.pool, result.retry_after)
            time.sleep(min(result.retry_after, _POLL_MAX, left))
        return result

    @contextmanager
    def leased(
        self, holder: str, ttl: float, *, timeout: float = 0.0, raise_on_failure: bool = True
    ) -> Iterator[Lease | None]:
        """Hold a lease for the ``with`` block and release it after.

        With ``raise_on_failure=False`` yields None instead of raising :class:`NoKeyAvailable`.
        """
        try:
            lease: Lease | None = self.acquire(holder, ttl, timeout=timeout)
        except NoKeyAvailable:
            if raise_on_failure:
                raise
            lease = None
        try:
            yield lease
        finally:
            if lease is not None:
                self.release(lease)

    def heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend ``lease`` to ``ttl`` seconds from now; False when it was lost (expired,
        reclaimed, or its key left the pool): stop using the key."""
        return self.heartbeat_until(lease, ttl) is not None

    def heartbeat_until(self, lease: Lease, ttl: float) -> float | None:
        """Like :meth:`heartbeat`, returning the new expiry (Redis clock) or None when lost."""
        _check_ttl(ttl)
        until = self._heartbeat.integer([self._leases_key(lease)], [lease.token, micros(ttl)])
        return to_seconds(until) if until else None

    def release(self, lease: Lease) -> bool:
        """Free ``lease``; False when it was already lost (reported, never raised)."""
        return bool(self._release.integer([self._leases_key(lease)], [lease.token]))

    def _leases_key(self, lease: Lease) -> str:
        if lease.pool != self.pool:
            raise ValueError(f"lease of pool {lease.pool!r} given to pool {self.pool!r}")
        return keys.pool_key_leases(self.pool, lease.key_id)

    # --- key status ---------------------------------------------------------------------------

    def cooldown(self, key_id: int, seconds: float) -> float | None:
        """Rest a key for ``seconds`` (a 429 / Retry-After); it comes back by itself.

        A running longer cooldown is kept. Returns when the cooldown ends (seconds since the
        epoch, Redis clock), or None when the key is not in the pool.
        """
        if not seconds > 0:
            raise ValueError(f"invalid cooldown {seconds!r}: must be > 0 seconds")
        until = self._key_action(key_id, "cooldown", micros(seconds))
        return to_seconds(until) if until else None

    def disable(self, key_id: int) -> bool:
        """Stop leasing a key (live leases run out); False when the key is not in the pool."""
        return bool(self._key_action(key_id, "disable"))

    def enable(self, key_id: int) -> bool:
        """Undo :meth:`disable` (a running cooldown still holds); False when not in the pool."""
        return bool(self._key_action(key_id, "enable"))

    def _key_action(self, key_id: int, action: str, arg: int = 0) -> int:
        config = keys.pool_key_config(self.pool, key_id)
        return self._admin.integer([self._members, config], [str(int(key_id)), action, arg])

    # --- reading ------------------------------------------------------------------------------

    def snapshot(self) -> list[KeyState]:
        """Every key's live state, read in one consistent view.

        :raises PoolNotLoaded: Redis holds no state for this pool.
        """
        reply = self._state.array([self._epoch, self._members], [self._prefix])
        if int(reply[0]) < 0:
            raise PoolNotLoaded(self.pool)
        rows = reply[2:]
        return [KeyState.from_reply(rows[i : i + 8]) for i in range(0, len(rows), 8)]

    def capacity(self) -> int:
        """How many leases could be granted right now across the pool."""
        return sum(state.available for state in self.snapshot())


def _status(value: bytes | str) -> Status:
    status = text(value)
    for known in get_args(Status):
        if status == known:
            return cast(Status, known)
    raise ValueError(f"unexpected key status in Redis: {status!r}")


def _check_ttl(ttl: float) -> None:
    if not ttl > 0:
        raise ValueError(f"invalid ttl {ttl!r}: must be > 0 seconds")
