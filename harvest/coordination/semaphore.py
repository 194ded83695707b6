"""A fair counting semaphore with expiring permits, shared through Redis.

"Redis in Action" 6.3 in one Lua script: a ticket counter orders callers, permits carry an
expiry on the Redis clock (a dead holder's permit comes back by itself), and callers blocked in
:meth:`Semaphore.acquire` are served first come, first served (a newcomer never overtakes them).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis

from harvest.coordination import keys
from harvest.coordination.scripts import LuaScript, micros, seconds
from harvest.errors import SemaphoreBusy

_POLL_MIN = 0.005
_POLL_MAX = 0.1
_PLACE_IN_LINE = 2.0  # a waiter that stops polling loses its place after this many seconds


class Semaphore:
    """At most ``limit`` permits held at once, each expiring ``ttl`` seconds after its last
    acquire or refresh unless released first."""

    def __init__(self, redis: Redis, name: str, limit: int) -> None:
        """
        :param redis: the coordination Redis client.
        :param name: semaphores with the same name share their permits.
        :param limit: how many permits may be held at once (>= 1).
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"invalid semaphore limit {limit!r}: must be an integer >= 1")
        self.name = name
        self.limit = limit
        self._owners = keys.semaphore_owners(name)
        self._timeouts = keys.semaphore_timeouts(name)
        self._waiters = keys.semaphore_waiters(name)
        self._waiter_timeouts = keys.semaphore_waiter_timeouts(name)
        self._counter = keys.semaphore_counter(name)
        self._acquire = LuaScript(redis, "semaphore_acquire")
        self._refresh = LuaScript(redis, "semaphore_refresh")
        self._release = LuaScript(redis, "semaphore_release")
        self._count = LuaScript(redis, "semaphore_count")

    def _try(self, token: str, ttl: float, place: float) -> float:
        """One attempt: 0.0 when the permit is granted, else seconds to wait before retrying."""
        reply = self._acquire.array(
            [self._owners, self._timeouts, self._counter, self._waiters, self._waiter_timeouts],
            [self.limit, token, micros(ttl), micros(place)],
        )
        return 0.0 if int(reply[0]) else max(seconds(int(reply[1])), _POLL_MIN)

    def acquire(self, holder: str, ttl: float, *, timeout: float = 0.0) -> str | None:
        """Take a permit; return its token, or None when none was free in time.

        :param holder: who takes it (part of the token, for debugging).
        :param ttl: seconds until the permit expires unless refreshed.
        :param timeout: seconds to wait in line for a permit (0: try once).
        """
        _check_ttl(ttl)
        token = f"{secrets.token_hex(8)}:{holder}"
        if timeout <= 0:
            return None if self._try(token, ttl, 0.0) else token
        deadline = time.monotonic() + timeout
        while (wait := self._try(token, ttl, _PLACE_IN_LINE)) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                self.release(token)  # leave the line
                return None
            time.sleep(min(wait, _POLL_MAX, left))
        return token

    def refresh(self, token: str, ttl: float) -> bool:
        """Extend a held permit to ``ttl`` seconds from now; False when it was lost."""
        _check_ttl(ttl)
        return bool(self._refresh.integer([self._owners, self._timeouts], [token, micros(ttl)]))

    def release(self, token: str) -> bool:
        """Give a permit back; False when this token held none (expired or released before)."""
        return bool(
            self._release.integer(
                [self._owners, self._timeouts, self._waiters, self._waiter_timeouts], [token]
            )
        )

    def held(self) -> int:
        """How many permits are held right now."""
        return self._count.integer([self._timeouts])

    @contextmanager
    def permit(
        self, holder: str, ttl: float, *, timeout: float = 0.0, raise_on_failure: bool = True
    ) -> Iterator[str | None]:
        """Hold a permit for the ``with`` block and release it after.

        Yields the token; with ``raise_on_failure=False`` yields None when no permit was free
        (otherwise :class:`SemaphoreBusy` is raised).
        """
        token = self.acquire(holder, ttl, timeout=timeout)
        if token is None and raise_on_failure:
            raise SemaphoreBusy(self.name, timeout)
        try:
            yield token
        finally:
            if token is not None:
                self.release(token)


def _check_ttl(ttl: float) -> None:
    if not ttl > 0:
        raise ValueError(f"invalid ttl {ttl!r}: must be > 0 seconds")
