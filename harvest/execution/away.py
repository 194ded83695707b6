"""Redis not answering during an attempt (stopped, restarted, cut off): which errors say so,
and the process's one warning when it goes and one when it is back (not one per job).

What an attempt does then is the core's decision (:mod:`harvest.execution.core`): at its gate
a job steps back to pending with its attempt refunded; after its call it still writes its
outcome. Both shells throw the same errors into it (redis.asyncio raises redis-py's classes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import redis

from harvest.outage import REDIS, Outages, describe

REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError)

log = logging.getLogger("harvest.runner")
outages = Outages(log, "key-pool calls")


def failed(exc: BaseException, during: str) -> str:
    """Note that Redis did not answer ``during`` (logged once per outage); the error, masked,
    for the job's deferral reason."""
    outages.failed(REDIS, exc, during)
    return f"Redis does not answer ({describe(exc)})"


def answered() -> None:
    """A key-pool call succeeded: the end of an outage is logged (nothing when there was none)."""
    outages.answered(REDIS)


@contextlib.contextmanager
def tolerated(during: str) -> Iterator[None]:
    """Around effects whose failure must not stop the attempt's fenced write (resting or
    disabling a key after the call): Redis not answering is noted and the attempt goes on to
    its write. A key the service rejected is disabled in Postgres all the same (see
    ``Gate.rejected``), so a pool rebuilt from Postgres leaves it out."""
    try:
        yield
    except REDIS_AWAY as exc:
        failed(exc, during)
