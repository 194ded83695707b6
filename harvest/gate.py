"""What stands between a held job and its handler: the API key pool and global rate limits.

Before a job starts (and before its attempt is counted) the worker takes, in this order, a
permit of the job's global rate limit (``@app.job(rate_limit="100/m")``) and a lease on a key of
its pool (``@app.job(pool="openai")``). Whatever cannot be had within a short wait sends the job
back to pending with a delay, without counting an attempt and without holding a worker slot.
The key lease is heartbeated with the job's lease and released in ``finally``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from harvest import keystore
from harvest.coordination.key_pool import Busy, KeyPool, Lease
from harvest.coordination.rate_limit import RateLimiter
from harvest.errors import PoolNotLoaded

if TYPE_CHECKING:
    from harvest.app import Harvest, JobSpec

log = logging.getLogger(__name__)

POLL = 0.05


@dataclass(frozen=True, slots=True)
class Wait:
    """The gate is closed for now: try again after ``seconds``."""

    seconds: float
    reason: str


class Gate:
    def __init__(self, app: Harvest) -> None:
        self.app = app
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._pools: dict[str, KeyPool] = {}
        self._limiters: dict[str, RateLimiter] = {}
        self._cipher: keystore.Cipher | None = None
        self._secrets: dict[int, str] = {}  # key id -> secret; a key's secret never changes
        self.last_used = keystore.LastUsedBuffer()

    # --- taking ---------------------------------------------------------------------------

    def rate_permit(self, spec: JobSpec) -> Wait | None:
        """One permit of the job's global rate limit, or how long until one is free."""
        if spec.rate_limit is None:
            return None
        limiter = self._limiters.get(spec.name)
        if limiter is None:
            limiter = RateLimiter(self.app.redis, f"job:{spec.name}", spec.rate_limit)
            self._limiters[spec.name] = limiter
        wait = limiter.try_acquire()
        return Wait(wait, f"rate limit {spec.rate_limit}") if wait else None

    def pool(self, name: str) -> KeyPool:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = KeyPool(self.app.redis, name)
        return pool

    def lease(self, pool_name: str, job_id: int) -> Lease | Wait:
        """A key lease within ``settings.key_wait`` seconds, or how long until one could be.

        A pool that Redis lost (restart, flush) is rebuilt from Postgres first."""
        pool = self.pool(pool_name)
        deadline = time.monotonic() + self.app.settings.key_wait
        holder = f"{self.holder}:{job_id}"
        while True:
            try:
                result = pool.lease(holder, self.app.settings.lease_ttl)
            except PoolNotLoaded:
                keystore.ensure_pool_loaded(self.app.engine, self.app.redis, pool_name)
                result = pool.lease(holder, self.app.settings.lease_ttl)
            if not isinstance(result, Busy):
                self.last_used.record(result.key_id)
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                return Wait(max(result.retry_after, POLL), f"no key free in pool {pool_name!r}")
            time.sleep(min(result.retry_after, left, 0.25))

    def secret(self, lease: Lease) -> str:
        """The leased key's secret, decrypted for the handler only. Kept in this worker's
        memory after the first use (a key's secret never changes: a new secret is a new key),
        so the gate costs no database round trip per job."""
        secret = self._secrets.get(lease.key_id)
        if secret is None:
            if self._cipher is None:
                self._cipher = keystore.Cipher.from_settings(self.app.settings)
            with self.app.engine.connect() as conn:
                secret = keystore.secret_for(conn, self._cipher, lease.key_id)
            self._secrets[lease.key_id] = secret
        return secret

    # --- keeping and giving back -----------------------------------------------------------

    def heartbeat(self, lease: Lease) -> bool:
        ok = self.pool(lease.pool).heartbeat(lease, self.app.settings.lease_ttl)
        if not ok:
            log.warning("key lease on key %s of pool %r was lost", lease.key_id, lease.pool)
        return ok

    def release(self, lease: Lease) -> None:
        try:
            if not self.pool(lease.pool).release(lease):
                log.warning("key lease on key %s of pool %r had expired", lease.key_id, lease.pool)
        except Exception as exc:
            log.warning("key lease not released (%s); it expires by itself", type(exc).__name__)
        if self.last_used.due():
            try:
                self.last_used.flush(self.app.engine)
            except Exception as exc:
                log.warning("last-used times not written (%s)", type(exc).__name__)

    # --- what the service said -------------------------------------------------------------

    def rate_limited(self, lease: Lease, retry_after: float) -> None:
        """The service answered 429: rest the key (it comes back by itself). The cooldown is
        written to Postgres too, so a pool rebuilt after Redis lost it still honours it."""
        until = self.pool(lease.pool).cooldown(lease.key_id, max(retry_after, 0.001))
        log.warning(
            "key %s of pool %r cooling for %.1fs (429)", lease.key_id, lease.pool, retry_after
        )
        if until is None:
            return
        try:
            with self.app.engine.begin() as conn:
                cooldown_until = datetime.fromtimestamp(until, UTC)
                keystore.set_status(conn, lease.key_id, "cooling", cooldown_until=cooldown_until)
        except Exception as exc:
            log.warning(
                "key %s cooldown not written to Postgres (%s)", lease.key_id, type(exc).__name__
            )

    def rejected(self, lease: Lease) -> None:
        """The service refused the key (401/403): disable it in Redis and in Postgres."""
        self.pool(lease.pool).disable(lease.key_id)
        with self.app.engine.begin() as conn:
            keystore.set_status(conn, lease.key_id, "disabled")
        log.error("key %s of pool %r disabled: the service rejected it", lease.key_id, lease.pool)
