"""Login throttling for the dashboard: failed Basic-auth attempts slow down the address that
makes them, with the state in Redis so that it holds across processes and replicas.

* Per client address (IPv6: per /64): 5 failures are free; then each failure locks the address
  for 1 s, 2 s, 4 s, ... (at most 15 minutes). While locked, every attempt from it is answered
  429 with ``Retry-After`` *without judging the password*: a right guess during a lock does not
  get in, so guessing from one address drops to a few a second, then to a few an hour.
* Per user name, from any address: past 20 failures in the window the user is "under attack",
  and addresses that never logged in as that user get 1 free failure instead of 5. The per-user
  count never locks anyone: the real user, from any address that has not failed itself, gets in
  at the first right password; an address where the user logged in before (30 days) keeps its 5.
* A right password clears its address's failures. Failure counters expire after an hour without
  failures.
* Redis down: fail open. The dashboard is what an operator needs during an outage, and it is
  behind a password anyway; a warning is logged (at most once a minute) while the throttle is
  off, and logins are checked as usual.

Every check and update is one Lua script (``login_attempt.lua``). Addresses and user names are
stored hashed; the client address is uvicorn's (``X-Forwarded-For`` only from 127.0.0.1, so a
reverse proxy on the same host is seen through).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError

from harvest.coordination import keys
from harvest.coordination.scripts import AsyncLuaScript
from harvest.redact import redact_text

log = logging.getLogger("harvest.web")

WARN_EVERY = 60.0  # seconds between two "throttling is off" warnings


@dataclass(frozen=True, slots=True)
class ThrottlePolicy:
    """How fast failed logins slow an address down."""

    free: int = 5  # failures per address before it is locked
    free_under_attack: int = 1  # the same, for unknown addresses while the user is under attack
    user_alert: int = 20  # failures of one user name (any address) that mean an attack
    base: float = 1.0  # seconds of the first lock; doubled at every further failure
    longest: float = 900.0  # seconds: the longest lock
    window: int = 3600  # seconds without failures after which the counts are forgotten
    known_for: int = 30 * 86400  # seconds an address where the user logged in stays known


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to answer: ``retry_after`` seconds when locked (429), else whether to let in."""

    allowed: bool
    retry_after: int | None = None


def address_bucket(host: str | None) -> str:
    """The throttling bucket of a client address: the address, or its /64 for IPv6."""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class LoginThrottle:
    """Judges login attempts against the counts in Redis (one asyncio client per event loop)."""

    def __init__(self, redis_url: str, policy: ThrottlePolicy | None = None) -> None:
        self._url = redis_url
        self.policy = policy or ThrottlePolicy()
        self._client: AsyncRedis | None = None
        self._script: AsyncLuaScript | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned = -math.inf

    def _bound(self) -> AsyncLuaScript:
        loop = asyncio.get_running_loop()
        if self._script is None or self._loop is not loop:
            self._client = AsyncRedis.from_url(
                self._url, socket_timeout=1, socket_connect_timeout=1
            )
            self._script = AsyncLuaScript(self._client, "login_attempt")
            self._loop = loop
        return self._script

    async def attempt(self, host: str | None, user: str, *, right: bool) -> Verdict:
        """Judge one attempt of ``user`` from ``host`` whose password was ``right`` or not."""
        address, who = _digest(address_bucket(host)), _digest(user)
        p = self.policy
        names = [
            keys.login_address_failures(address),
            keys.login_address_lock(address),
            keys.login_user_failures(who),
            keys.login_known(who, address),
        ]
        args = [1 if right else 0, p.free, p.free_under_attack, p.user_alert]
        args += [round(p.base * 1000), round(p.longest * 1000), p.window, p.known_for]
        try:
            reply: list[Any] = await self._bound().array(names, args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._warn(exc)
            return Verdict(allowed=right)
        if int(reply[0]) == 0:
            return Verdict(allowed=False, retry_after=max(1, math.ceil(int(reply[1]) / 1000)))
        return Verdict(allowed=int(reply[0]) == 1)

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            lines = redact_text(str(exc)).splitlines()
            log.warning(
                "login throttling is off: Redis did not answer (%s); logins are still checked",
                lines[0] if lines else type(exc).__name__,
            )

    async def aclose(self) -> None:
        client, self._client, self._script = self._client, None, None
        if client is not None:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await client.aclose()
