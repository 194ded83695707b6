"""Outages of Postgres, Redis or the broker, seen by a running process's periodic work (the
dispatch, rescue, schedules and maintenance ticks; beat's sends and leader election).

Logged once per state change, not once per tick: one warning when a service stops answering,
one line when it answers again, with how long it was away and how many ticks failed
meanwhile. Errors that are not a service's absence are not this module's business: they
propagate as before.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import psycopg
import redis
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from harvest.errors import ServiceUnavailable
from harvest.redact import redact_text

POSTGRES, REDIS, BROKER = "Postgres", "Redis", "the broker"


def service_of(exc: BaseException) -> str | None:
    """Which service an error says is away; None for any other error."""
    if isinstance(exc, ServiceUnavailable):
        return {"postgres": POSTGRES, "redis": REDIS}.get(exc.service.lower(), exc.service)
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeout | psycopg.OperationalError):
        return POSTGRES
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return POSTGRES
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return REDIS
    if isinstance(exc, BrokerError | ConnectionError):
        return BROKER
    return None


def describe(exc: BaseException) -> str:
    """The error's type and first line, masked."""
    lines = redact_text(str(getattr(exc, "orig", None) or exc)).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@dataclass(slots=True)
class _Away:
    since: float
    failures: int


class Outages:
    """Which services this process finds away, since when, and how many times it failed."""

    def __init__(self, log: logging.Logger, what: str = "attempts") -> None:
        self.log, self.what = log, what
        self._away: dict[str, _Away] = {}
        self._lock = threading.Lock()

    def failed(self, service: str, exc: BaseException, during: str) -> None:
        """A tick (``during``) failed because ``service`` did not answer."""
        with self._lock:
            away = self._away.get(service)
            if away is not None:
                away.failures += 1
                return
            self._away[service] = _Away(time.monotonic(), 1)
        self.log.warning(
            "%s does not answer (%s, during %s); logged again when it does",
            service,
            describe(exc),
            during,
        )

    def answered(self, service: str) -> None:
        """``service`` answered (a tick that needs it succeeded). Nothing to do when no service
        is away, read without the lock: hot paths (every key-pool call) call it."""
        if not self._away:
            return
        with self._lock:
            away = self._away.pop(service, None)
        if away is not None:
            self.log.warning(
                "%s answers again after %.1f s (%d failed %s meanwhile)",
                service,
                time.monotonic() - away.since,
                away.failures,
                self.what,
            )

    def away(self, service: str) -> bool:
        with self._lock:
            return service in self._away

    def failures(self, service: str) -> int:
        with self._lock:
            away = self._away.get(service)
            return away.failures if away is not None else 0
