"""The I/O of what stands between a held job and its handler: global rate limits and the API
key pool. What to do with the answers (wait, defer, lease) is decided in
:func:`harvest.execution.core.gate`; these classes only ask Redis and Postgres.

:class:`Gate` does it with blocking calls (sync handlers), :class:`AsyncGate` with awaits on
``redis.asyncio`` (async handlers) for the hot path (permit, lease, renew, release, 429). The
rare paths that read Postgres (a key's secret, once per key per process; rebuilding a pool
Redis lost; writing a key's cooldown or disabled status) are the blocking ones, run off the
event loop in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError

from harvest import keystore
from harvest.coordination.key_pool import (
    MAX_BATCH,
    AsyncKeyPool,
    Busy,
    KeyPool,
    Lease,
    Release,
    Throttled,
)
from harvest.coordination.rate_limit import AsyncRateLimiter, RateLimiter
from harvest.coordination.turns import PerTurn
from harvest.errors import PoolNotLoaded
from harvest.execution.handoff import Faults
from harvest.service_limits import Announced

if TYPE_CHECKING:
    from harvest.app import Harvest, JobSpec

log = logging.getLogger(__name__)
FREED_MIN = 0.01  # seconds: a shorter wait for a freed key is a plain sleep (BLPOP's 0 is forever)


class Gate:
    def __init__(self, app: Harvest) -> None:
        self.app = app
        self.ttl = app.settings.lease_ttl
        self._pools: dict[str, KeyPool] = {}
        self._limiters: dict[str, RateLimiter] = {}
        self._cipher: keystore.Cipher | None = None
        self._secrets: dict[int, str] = {}  # key id -> secret; a key's secret never changes
        self.last_used = keystore.LastUsedBuffer()
        self.faults = Faults()  # the keys that answered 429 or were refused here: no passing

    def pool(self, name: str) -> KeyPool:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = KeyPool(self.app.redis, name)
        return pool

    def rate_permit(self, spec: JobSpec) -> float:
        """One permit of the job's global rate limit: 0.0, or seconds until one is free."""
        assert spec.rate_limit is not None
        limiter = self._limiters.get(spec.name)
        if limiter is None:
            limiter = self._limiters[spec.name] = RateLimiter(
                self.app.redis, f"job:{spec.name}", spec.rate_limit
            )
        return limiter.try_acquire()

    def try_lease(self, pool: str, holder: str, cost: int = 0) -> Lease | Busy | None:
        """A key lease now (``cost`` tokens reserved on it), or Busy; None when Redis holds no
        such pool (rebuild it)."""
        try:
            result = self.pool(pool).lease(holder, self.ttl, cost=cost)
        except PoolNotLoaded:
            return None
        if isinstance(result, Lease):
            self.last_used.record(result.key_id)
        return result

    def release_then_lease(
        self,
        done: Lease,
        pool: str,
        holder: str,
        cost: int = 0,
        *,
        used: int | None = None,
        succeeded: bool = False,
        announced: Announced | None = None,
    ) -> Lease | Busy | None:
        """:meth:`release` of ``done`` and :meth:`try_lease` in ``pool`` in one round trip (the
        next job of a message taking a key as the job before gives its own back); each alone
        when that fails, so a release is never lost to the lease's error."""
        settle = (used, succeeded, announced)
        if done.pool != pool:
            self.release(done, *settle)
            return self.try_lease(pool, holder, cost)
        try:
            freed, result = self.pool(pool).release_then_lease(
                done, holder, self.ttl, used=used, succeeded=succeeded, announced=announced,
                cost=cost,
            )  # fmt: skip
        except PoolNotLoaded:
            return None
        except Exception as exc:
            log.info("release and lease in one round trip failed (%s); each alone",
                     type(exc).__name__)  # fmt: skip
            self.release(done, *settle)
            return self.try_lease(pool, holder, cost)
        self.settled(done, freed, result)
        self.flush_last_used()
        return result

    def reused(self, lease: Lease) -> None:
        """A key lease passed from one job to the next without Redis: its key was used."""
        self.last_used.record(lease.key_id)

    def settled(self, done: Lease, freed: bool, result: Lease | Busy) -> None:
        """What a release-then-lease said: the lease given back had expired; a key was used."""
        if not freed:
            _expired(done)
        if isinstance(result, Lease):
            self.last_used.record(result.key_id)

    def load_pool(self, pool: str) -> None:
        """Rebuild a pool Redis lost (restart, flush) from Postgres, under its lock."""
        keystore.ensure_pool_loaded(self.app.engine, self.app.redis, pool)

    def secret(self, lease: Lease) -> str:
        """The leased key's secret, decrypted for the handler only. Kept in this process after
        the first use (a key's secret never changes: a new secret is a new key), so the gate
        costs no database round trip per job."""
        secret = self._secrets.get(lease.key_id)
        if secret is None:
            if self._cipher is None:
                self._cipher = keystore.Cipher.from_settings(self.app.settings)
            with self.app.engine.connect() as conn:
                secret = keystore.secret_for(conn, self._cipher, lease.key_id)
            self._secrets[lease.key_id] = secret
        return secret

    def cached_secret(self, lease: Lease) -> str | None:
        return self._secrets.get(lease.key_id)

    def await_freed(self, pool: str, seconds: float) -> None:
        """Block ``seconds``, or less: until a process gives a key of ``pool`` back to Redis
        while jobs wait for one (:meth:`KeyPool.await_freed`). Where Redis fails, a sleep."""
        if seconds < FREED_MIN:
            time.sleep(seconds)
            return
        until = time.monotonic() + seconds
        try:
            self.pool(pool).await_freed(seconds)
        except RedisError:
            time.sleep(max(until - time.monotonic(), 0.0))

    def heartbeat_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Renew key leases (one round trip per pool); False for each one lost."""
        ok: list[bool] = []
        for pool, group in _by_pool(leases):
            ok += self.pool(pool).heartbeat_many(group, self.ttl)
        return ok

    def release(
        self,
        lease: Lease,
        used: int | None = None,
        succeeded: bool = False,
        announced: Announced | None = None,
    ) -> None:
        """Free the lease, settling its token reservation with ``used``, growing the key's
        learned limits back when the call ``succeeded``, keeping what the service
        ``announced`` (see KeyPool.release)."""
        try:
            pool = self.pool(lease.pool)
            if not pool.release(lease, used=used, succeeded=succeeded, announced=announced):
                _expired(lease)
        except Exception as exc:
            log.warning("key lease not released (%s); it expires by itself", type(exc).__name__)
        self.flush_last_used()

    def flush_last_used(self) -> None:
        if self.last_used.due():
            try:
                self.last_used.flush(self.app.engine)
            except Exception as exc:
                log.warning("last-used times not written (%s)", type(exc).__name__)

    def rate_limited(self, lease: Lease, seconds: float, exhausted: bool = False) -> None:
        """The service answered 429: rest the key (it comes back by itself), and lower its
        learned limits when its declared ones had room (see KeyPool.throttle)."""
        with self.faults.writing(lease, self.ttl) as fault:
            done = self.pool(lease.pool).throttle(lease, seconds, exhausted=exhausted)
            fault.until = done.until if done else None
        _lowered(lease, done)
        self.record_cooldown(lease, fault.until, seconds)

    def rejected(self, lease: Lease) -> None:
        """The service refused the key (401/403): disable it in Redis and in Postgres (in
        Postgres even when Redis fails: a pool rebuilt from it leaves the key out)."""
        try:
            with self.faults.writing(lease, self.ttl):
                self.pool(lease.pool).disable(lease.key_id)
        finally:
            self.record_disabled(lease)

    def record_cooldown(self, lease: Lease, until: float | None, seconds: float) -> None:
        """Write a cooldown to Postgres too, so a pool rebuilt after Redis lost it honours it."""
        log.warning("key %s of pool %r cooling for %.1fs (429)", lease.key_id, lease.pool, seconds)
        if until is None:
            return
        try:
            with self.app.engine.begin() as conn:
                when = datetime.fromtimestamp(until, UTC)
                keystore.set_status(conn, lease.key_id, "cooling", cooldown_until=when)
        except Exception as exc:
            log.warning("key %s cooldown not written (%s)", lease.key_id, type(exc).__name__)

    def record_disabled(self, lease: Lease) -> None:
        with self.app.engine.begin() as conn:
            keystore.set_status(conn, lease.key_id, "disabled")
        log.error("key %s of pool %r disabled: the service rejected it", lease.key_id, lease.pool)


class AsyncGate:
    """The hot path of :class:`Gate` on an event loop; cold paths go to ``gate`` in a thread."""

    def __init__(self, gate: Gate, redis: AsyncRedis) -> None:
        self.gate = gate
        self.ttl = gate.ttl
        self._redis = redis
        self._pools: dict[str, AsyncKeyPool] = {}
        self._limiters: dict[str, AsyncRateLimiter] = {}
        # The tries and releases of one pool made in one turn of the loop go to Redis together.
        self._tries = PerTurn(self._lease_each, MAX_BATCH, self._give_back)
        self._releases = PerTurn(self._release_each, MAX_BATCH)

    def pool(self, name: str) -> AsyncKeyPool:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = AsyncKeyPool(self._redis, name)
        return pool

    async def rate_permit(self, spec: JobSpec) -> float:
        assert spec.rate_limit is not None
        limiter = self._limiters.get(spec.name)
        if limiter is None:
            limiter = self._limiters[spec.name] = AsyncRateLimiter(
                self._redis, f"job:{spec.name}", spec.rate_limit
            )
        return await limiter.try_acquire()

    async def try_lease(self, pool: str, holder: str, cost: int = 0) -> Lease | Busy | None:
        """A lease now, or Busy; None: Redis holds no such pool. The tries for a pool (at one
        cost) made in the same turn of the loop, such as a message's jobs arriving together,
        go to Redis as one script: a try at a full pool reads every key, once for them all."""
        return await self._tries((pool, cost), holder)

    async def _lease_each(
        self, pool_cost: tuple[str, int], holders: list[str]
    ) -> list[Lease | Busy | None]:
        pool, cost = pool_cost
        try:
            each = await self.pool(pool).lease_each(holders, self.ttl, cost=cost)
        except PoolNotLoaded:
            return [None] * len(holders)
        for result in each:
            if isinstance(result, Lease):
                self.gate.last_used.record(result.key_id)
        return [*each]

    async def _give_back(self, result: Lease | Busy | None) -> None:
        """A lease taken for a job that stopped waiting (cancelled) goes back."""
        if isinstance(result, Lease):
            await self.release(result)

    async def load_pool(self, pool: str) -> None:
        await asyncio.to_thread(self.gate.load_pool, pool)

    async def secret(self, lease: Lease) -> str:
        cached = self.gate.cached_secret(lease)
        return cached if cached is not None else await asyncio.to_thread(self.gate.secret, lease)

    async def await_freed(self, pool: str, seconds: float) -> None:
        """:meth:`Gate.await_freed` on the loop: a key freed in another process goes to a job
        waiting here at once, not at its next poll."""
        if seconds < FREED_MIN:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        try:
            await self.pool(pool).await_freed(seconds)
        except RedisError:
            await asyncio.sleep(max(until - loop.time(), 0.0))

    async def heartbeat_many(self, leases: Sequence[Lease]) -> list[bool]:
        ok: list[bool] = []
        for pool, group in _by_pool(leases):
            ok += await self.pool(pool).heartbeat_many(group, self.ttl)
        return ok

    async def release(
        self,
        lease: Lease,
        used: int | None = None,
        succeeded: bool = False,
        announced: Announced | None = None,
    ) -> None:
        """Give ``lease`` back; the releases of a pool made in one turn of the loop (jobs
        ending together) go in one round trip. A failure is logged: the lease expires."""
        try:
            if not await self._releases(lease.pool, (lease, used, succeeded, announced)):
                _expired(lease)
        except Exception as exc:
            log.warning("key lease not released (%s); it expires by itself", type(exc).__name__)
        if self.gate.last_used.due():
            await asyncio.to_thread(self.gate.flush_last_used)

    def reused(self, lease: Lease) -> None:
        self.gate.reused(lease)

    async def _release_each(self, pool: str, releases: list[Release]) -> list[bool]:
        return await self.pool(pool).release_each(releases)

    async def release_then_lease(
        self, done: Lease, holder: str, cost: int = 0, *, used: int | None = None,
        succeeded: bool = False, announced: Announced | None = None,
    ) -> Lease | Busy | None:  # fmt: skip
        """:meth:`Gate.release_then_lease` in ``done``'s own pool (a key freed in this process,
        leased in the same round trip for a job of it that waits); when that fails, the release
        alone, and None (the waiter leases on its own)."""
        try:
            freed, result = await self.pool(done.pool).release_then_lease(
                done, holder, self.ttl, used=used, succeeded=succeeded, announced=announced,
                cost=cost,
            )  # fmt: skip
        except PoolNotLoaded:
            return None
        except Exception as exc:
            log.info("release and lease in one round trip failed (%s); release alone",
                     type(exc).__name__)  # fmt: skip
            await self.release(done, used, succeeded, announced)
            return None
        self.gate.settled(done, freed, result)
        if self.gate.last_used.due():
            await asyncio.to_thread(self.gate.flush_last_used)
        return result

    async def rate_limited(self, lease: Lease, seconds: float, exhausted: bool = False) -> None:
        with self.gate.faults.writing(lease, self.gate.ttl) as fault:
            done = await self.pool(lease.pool).throttle(lease, seconds, exhausted=exhausted)
            fault.until = done.until if done else None
        _lowered(lease, done)
        await asyncio.to_thread(self.gate.record_cooldown, lease, fault.until, seconds)

    async def rejected(self, lease: Lease) -> None:
        try:
            with self.gate.faults.writing(lease, self.gate.ttl):
                await self.pool(lease.pool).disable(lease.key_id)
        finally:
            await asyncio.to_thread(self.gate.record_disabled, lease)


def _by_pool(leases: Sequence[Lease]) -> list[tuple[str, list[Lease]]]:
    """Leases grouped by pool, order kept within each (results come back in that order)."""
    groups: dict[str, list[Lease]] = {}
    for lease in leases:
        groups.setdefault(lease.pool, []).append(lease)
    return list(groups.items())


def _lowered(lease: Lease, done: Throttled | None) -> None:
    if done is not None and done.lowered:
        rate = f", rate {done.rate} a window" if done.rate else ""
        log.warning(
            "key %s of pool %r: 429 with room under its declared limits; effective "
            "concurrency lowered to %s%s (grows back on success)",
            lease.key_id, lease.pool, done.max_concurrency, rate,
        )  # fmt: skip


def _expired(lease: Lease) -> None:
    log.warning("key lease on key %s of pool %r had expired", lease.key_id, lease.pool)
