"""Rates (``"60/m"``) and a global rate limiter shared by every process through Redis.

The limiter is an exact sliding-window log: a ZSET of admission times, checked and appended in
one Lua script against the Redis clock. In any window of one period, never more than ``count``
calls are admitted (a fixed window would let ``2 * count`` through around a boundary).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from harvest.coordination import keys
from harvest.coordination.scripts import AsyncLuaScript, LuaScript, micros, seconds
from harvest.errors import RateLimited

MIN_PERIOD = 0.001  # the window is kept in microseconds; shorter periods make no sense
MAX_PERIOD = 366 * 86400.0
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(?P<count>\d+)\s*/\s*(?P<mult>\d+(?:\.\d+)?)?\s*(?P<unit>[smhd])\s*$")


@dataclass(frozen=True)
class Rate:
    """``count`` calls per ``period_seconds``."""

    count: int
    period_seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"invalid rate count {self.count!r}: must be an integer >= 1")
        if not MIN_PERIOD <= self.period_seconds <= MAX_PERIOD:
            raise ValueError(
                f"invalid rate period {self.period_seconds!r}: must be between "
                f"{MIN_PERIOD:g} and {MAX_PERIOD:g} seconds"
            )

    @property
    def period_micros(self) -> int:
        return micros(self.period_seconds)

    def __str__(self) -> str:
        return f"{self.count}/{self.period_seconds:g}s"


def parse_rate(text: str) -> Rate:
    """Parse ``"60/m"``, ``"5/s"``, ``"1000/h"``, ``"10/2s"`` (units s, m, h, d)."""
    match = _RATE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"invalid rate {text!r}: expected <count>/<period> such as '60/m', '5/s', "
            "'1000/h' or '10/2s' (units s, m, h, d)"
        )
    mult = float(match["mult"]) if match["mult"] else 1.0
    try:
        return Rate(int(match["count"]), mult * _UNITS[match["unit"]])
    except ValueError as exc:
        raise ValueError(f"invalid rate {text!r}: {exc}") from None


class RateLimiter:
    """At most ``rate.count`` calls per ``rate.period_seconds``, across every process."""

    def __init__(self, redis: Redis, name: str, rate: Rate | str) -> None:
        """
        :param redis: the coordination Redis client.
        :param name: the limit's name; limiters with the same name share one window.
        :param rate: a :class:`Rate` or its text form (``"60/m"``).
        """
        self.name = name
        self.rate = parse_rate(rate) if isinstance(rate, str) else rate
        self._key = keys.rate_window(name)
        self._script = LuaScript(redis, "rate_limit")

    def try_acquire(self) -> float:
        """Take one permit if the window has room: 0.0 when admitted, else seconds to wait."""
        return _verdict(self._script.array([self._key], _permit_args(self.rate)))

    def acquire(self, *, raise_on_failure: bool = True) -> bool:
        """Take one permit now.

        :param raise_on_failure: raise :class:`RateLimited` (with ``retry_after``) when the
            window is full; with ``False`` return ``False`` instead.
        """
        wait = self.try_acquire()
        if wait and raise_on_failure:
            raise RateLimited(wait, name=self.name)
        return not wait

    def wait(self, timeout: float) -> bool:
        """Block until a permit is taken (True) or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while True:
            wait = self.try_acquire()
            if not wait:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or wait > left:
                return False
            time.sleep(wait + 0.001)


class AsyncRateLimiter:
    """:class:`RateLimiter`'s ``try_acquire`` for an asyncio client (the same window)."""

    def __init__(self, redis: AsyncRedis, name: str, rate: Rate | str) -> None:
        self.name = name
        self.rate = parse_rate(rate) if isinstance(rate, str) else rate
        self._key = keys.rate_window(name)
        self._script = AsyncLuaScript(redis, "rate_limit")

    async def try_acquire(self) -> float:
        """See :meth:`RateLimiter.try_acquire`."""
        return _verdict(await self._script.array([self._key], _permit_args(self.rate)))


def _permit_args(rate: Rate) -> list[str | int]:
    return [rate.count, rate.period_micros, secrets.token_hex(8)]


def _verdict(reply: list[object]) -> float:
    """0.0 when admitted, else the seconds until a permit would be."""
    admitted, wait = reply
    return 0.0 if int(str(admitted)) else max(seconds(int(str(wait))), 1e-6)
