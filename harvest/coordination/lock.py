"""A distributed lock with fencing numbers, optional auto-renewal, and leader election on it.

Every acquisition takes a fencing number (``INCR``): pass ``lock.fence`` along with the writes
the lock protects, and have the store refuse a write whose fence is older than the last one it
saw. A lock can always be lost (a pause longer than its TTL); the fence is what makes that safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

from redis import Redis, RedisError

from harvest.coordination import keys
from harvest.coordination.scripts import LuaScript
from harvest.errors import LockNotAcquired

log = logging.getLogger(__name__)

_POLL_MIN = 0.005
_POLL_MAX = 0.1


class Lock:
    """A lock owned by a random token, expiring after ``ttl`` seconds unless extended.

    ``lost`` is set when auto-renewal finds the lock gone (or cannot reach Redis for a whole
    TTL); the owner should stop the protected work. Losing a lock is reported, never raised.
    """

    def __init__(
        self,
        redis: Redis,
        name: str,
        ttl: float,
        *,
        auto_renew: bool = False,
        renew_interval: float | None = None,
        blocking_timeout: float = 10.0,
    ) -> None:
        """
        :param redis: the coordination Redis client.
        :param name: locks with the same name exclude each other.
        :param ttl: seconds the lock lives after an acquire or extend.
        :param auto_renew: extend the lock from a daemon thread while it is held.
        :param renew_interval: seconds between renewals (default ``ttl / 3``).
        :param blocking_timeout: how long ``with lock:`` waits before raising.
        """
        if not ttl > 0:
            raise ValueError(f"invalid lock ttl {ttl!r}: must be > 0 seconds")
        self.name = name
        self.ttl = ttl
        self.auto_renew = auto_renew
        self.renew_interval = renew_interval if renew_interval is not None else ttl / 3
        self.blocking_timeout = blocking_timeout
        self.token: str | None = None
        self.fence: int | None = None
        self.lost = threading.Event()
        self._keys = [keys.lock(name), keys.lock_fence(name)]
        self._acquire = LuaScript(redis, "lock_acquire")
        self._extend = LuaScript(redis, "lock_extend")
        self._release = LuaScript(redis, "lock_release")
        self._renewer: _Renewer | None = None

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))

    def _try(self, token: str) -> float:
        """One attempt: 0.0 when owned now, else seconds until the current owner's TTL ends."""
        fence, info = (int(v) for v in self._acquire.array(self._keys, [token, self._ttl_ms]))
        if fence:
            self.token, self.fence = token, fence
            return 0.0
        return max(info / 1000, _POLL_MIN)

    def acquire(self, *, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock (or renew it when this object holds it); True when owned.

        :param blocking: wait for the current owner to release or expire.
        :param timeout: seconds to wait when blocking (default ``blocking_timeout``).
        """
        token = self.token or secrets.token_hex(16)
        limit = self.blocking_timeout if timeout is None else timeout
        deadline = time.monotonic() + (limit if blocking else 0.0)
        while (wait := self._try(token)) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop_renewal()
                self.token = self.fence = None
                return False
            time.sleep(min(wait, _POLL_MAX, left))
        self._start_renewal()
        return True

    def extend(self, ttl: float | None = None) -> bool:
        """Reset the TTL (to ``ttl`` or the lock's own); False when this object is not the owner."""
        token = self.token
        if token is None:
            return False
        ms = max(1, round((ttl if ttl is not None else self.ttl) * 1000))
        return bool(self._extend.integer(self._keys[:1], [token, ms]))

    def release(self) -> bool:
        """Release the lock; False when it was no longer ours (expired or taken over)."""
        self._stop_renewal()
        token, self.token, self.fence = self.token, None, None
        if token is None:
            return False
        return bool(self._release.integer(self._keys[:1], [token]))

    def _start_renewal(self) -> None:
        self.lost.clear()
        if self.auto_renew and self.token and (self._renewer is None or not self._renewer.alive):
            self._renewer = _Renewer(self, self.token)
            self._renewer.start()

    def _stop_renewal(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise LockNotAcquired(self.name, self.blocking_timeout)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.release():
            log.warning("lock %r was lost before release (expired or taken over)", self.name)

    @contextmanager
    def held(
        self, *, timeout: float | None = None, raise_on_failure: bool = True
    ) -> Iterator[bool]:
        """Hold the lock for the ``with`` block; yields whether it is held.

        With ``raise_on_failure=False`` a lock held elsewhere yields False instead of raising
        :class:`LockNotAcquired`.
        """
        acquired = self.acquire(timeout=timeout)
        if not acquired and raise_on_failure:
            raise LockNotAcquired(self.name, self.blocking_timeout if timeout is None else timeout)
        try:
            yield acquired
        finally:
            if acquired and not self.release():
                log.warning("lock %r was lost before release (expired or taken over)", self.name)


class _Renewer:
    """Daemon thread extending one token's lock; sets ``lock.lost`` and stops when it cannot."""

    def __init__(self, lock: Lock, token: str) -> None:
        self._lock = lock
        self._token = token
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"harvest-lock-renew:{lock.name}", daemon=True
        )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, self._lock.renew_interval))

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self._lock.renew_interval):
            try:
                ok = self._renew()
            except RedisError as exc:
                if time.monotonic() - last_ok < self._lock.ttl:
                    log.warning("lock %r: renewal failed, will retry: %s", self._lock.name, exc)
                    continue
                ok = False
            if not ok:
                self._give_up()
                return
            last_ok = time.monotonic()

    def _renew(self) -> bool:
        lock = self._lock
        return bool(lock._extend.integer(lock._keys[:1], [self._token, lock._ttl_ms]))

    def _give_up(self) -> None:
        if not self._stop.is_set():
            log.warning("lock %r was lost: renewal failed", self._lock.name)
            self._lock.lost.set()


@dataclass(frozen=True)
class Leadership:
    """The answer of :meth:`LeaderElector.is_leader`: truthy when leader, with its fence."""

    leader: bool
    fence: int | None

    def __bool__(self) -> bool:
        return self.leader


class LeaderElector:
    """One leader among many candidates: call :meth:`is_leader` more often than ``ttl``."""

    def __init__(self, redis: Redis, name: str, ttl: float) -> None:
        """
        :param redis: the coordination Redis client.
        :param name: the election; candidates with the same name compete.
        :param ttl: seconds a leader stays leader without calling :meth:`is_leader` again.
        """
        self.name = name
        self._lock = Lock(redis, keys.leader_lock_name(name), ttl)

    def is_leader(self) -> Leadership:
        """Become leader if nobody is, or renew when already leader; never blocks."""
        if self._lock.acquire(blocking=False):
            return Leadership(True, self._lock.fence)
        return Leadership(False, None)

    def step_down(self) -> bool:
        """Give up leadership now; False when this candidate was not the leader."""
        return self._lock.release()
