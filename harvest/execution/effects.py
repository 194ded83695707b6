"""The I/O an attempt asks for, as values.

:mod:`harvest.execution.core` decides what happens to a job and *yields* these; a shell (blocking
in :mod:`~harvest.execution.sync_shell`, asyncio in :mod:`~harvest.execution.async_shell`)
performs each one and sends back the value named in its docstring. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harvest.execution import sql

if TYPE_CHECKING:
    from harvest.app import JobSpec
    from harvest.coordination.key_pool import Lease
    from harvest.execution.observe import AttemptEnded, AttemptStarted, Deferred
    from harvest.execution.tracking import Tracked
    from harvest.jobs import Started
    from harvest.service_limits import Announced
    from harvest.usage import Call


@dataclass(frozen=True, slots=True)
class Clock:
    """-> float: monotonic seconds."""


@dataclass(frozen=True, slots=True)
class RatePermit:
    """-> float: take one permit of the job's global rate limit; 0.0 when admitted, else the
    seconds until one would be."""

    spec: JobSpec


@dataclass(frozen=True, slots=True)
class LeaseKey:
    """-> Lease | Busy | None: lease a key of ``pool`` now, reserving ``cost`` tokens on it
    (0: none; None: Redis holds no such pool)."""

    pool: str
    holder: str
    cost: int = 0


@dataclass(frozen=True, slots=True)
class LoadPool:
    """-> None: rebuild ``pool`` in Redis from Postgres (Redis lost it)."""

    pool: str


@dataclass(frozen=True, slots=True)
class AwaitKey:
    """-> Lease | None: wait up to ``seconds`` (``until`` if sooner), or less when this process
    frees a key of ``pool``. A shell may hand the freed slot over: a lease for ``holder``
    (``cost`` tokens reserved), taken in the same round trip as the key's release; None: lease
    it yourself.

    ``until``: when ``pool`` is the job's only pool, how long it may still wait in all. A shell
    may then keep it in line that long, leasing for the first in line every ``seconds`` (one
    try per pool, not one per waiting job); None: come back after ``seconds``."""

    pool: str
    seconds: float
    holder: str = ""
    cost: int = 0
    until: float | None = None


@dataclass(frozen=True, slots=True)
class Defer:
    """-> bool: the held job back to pending without an attempt (False: its lease was lost)."""

    row: sql.Defer


@dataclass(frozen=True, slots=True)
class Start:
    """-> Started | JobStatus | None: the fenced start (see :func:`sql.start`)."""

    job_id: int
    token: Any  # uuid.UUID


@dataclass(frozen=True, slots=True)
class Secret:
    """-> str: the leased key's secret, decrypted (for the handler only)."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class RunHandler:
    """-> HandlerResult: run the handler under the job's time limit."""

    job: Started
    spec: JobSpec
    tracked: Tracked
    lease: Lease | None
    secret: str | None


@dataclass(frozen=True, slots=True)
class HandlerResult:
    """What running a handler came to."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    timed_out: bool = False  # it ran past its time limit (and was stopped, where possible)
    cancelled: bool = False  # its cancellation was requested (ctx.cancelled)
    handed_back: bool = False  # the worker stopped it at shutdown
    ended_elsewhere: bool = False  # the attempt was ended at its deadline while it ran on


@dataclass(frozen=True, slots=True)
class CoolKey:
    """-> None: the service answered 429: rest the key ``seconds``, and lower its learned
    limits unless its declared ones were used up anyway (``exhausted``: the 429's own headers
    said nothing was left)."""

    lease: Lease
    seconds: float
    exhausted: bool = False


@dataclass(frozen=True, slots=True)
class DisableKey:
    """-> None: the service refused the key: disable it (Redis and Postgres)."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class Finish:
    """-> bool: the attempt's one fenced write (False: its lease was lost; nothing written).
    ``ran``: seconds its handler ran (how long the write may wait to share a statement)."""

    row: sql.Finish
    ran: float = 0.0


@dataclass(frozen=True, slots=True)
class ReleaseKey:
    """-> None: give the key lease back (only its holder can), settling its token reservation
    with ``used`` (None: nothing reported, the reservation stands; 0: no call was made);
    ``succeeded``: the call succeeded (lowered limits grow back); ``announced``: what the
    service's rate-limit headers said is left."""

    lease: Lease
    used: int | None = None
    succeeded: bool = False
    announced: Announced | None = None


@dataclass(frozen=True, slots=True)
class RenewKey:
    """-> bool: renew the key lease for its TTL now (False: it is no longer held)."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class CountUsage:
    """-> None: add one call made with a key to the process's usage tally (memory, no I/O;
    :mod:`harvest.usage` writes it in time windows)."""

    call: Call


@dataclass(frozen=True, slots=True)
class Bump:
    """-> None: add to a counter of ``harvest_counters``."""

    name: str
    n: int = 1


@dataclass(frozen=True, slots=True)
class Notify:
    """-> None: tell the observers (job-level logs, Celery task events)."""

    event: Deferred | AttemptStarted | AttemptEnded


Effect = (
    Clock
    | RatePermit
    | LeaseKey
    | LoadPool
    | AwaitKey
    | Defer
    | Start
    | Secret
    | RunHandler
    | CoolKey
    | DisableKey
    | Finish
    | ReleaseKey
    | RenewKey
    | CountUsage
    | Bump
    | Notify
)
