"""What a worker process knows about each job it holds, and what a heartbeat round decides.

One :class:`Tracked` per held job, shared by the attempt (which sets its key lease and marks
it finishing) and the heartbeat (which renews its leases and marks it lost or cancelled). The
decisions of a heartbeat round are pure functions here; the blocking heartbeat thread and the
asyncio heartbeat task only do the I/O around them.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harvest.context import CancelFlag
from harvest.execution import away
from harvest.execution import effects as fx
from harvest.jobs import Started
from harvest.service_limits import Announced, announced

if TYPE_CHECKING:
    from harvest.execution.sql import Held, Pair

log = logging.getLogger("harvest.heartbeat")

KEY_MARGIN = 0.2  # of the TTL: a key lease renewed at t is trusted until t + ttl * (1 - this)


@dataclass(slots=True, eq=False)
class Tracked:
    job_id: int
    token: uuid.UUID
    name: str = ""
    attempt: int = 0  # the attempt it is (or will be, once started)
    started: Started | None = None  # its attempt, once begun (before its key, when it waits)
    max_attempts: int = 0  # attempts it is allowed (0: not known)
    deadline: float = math.inf  # monotonic; a blocking handler past it means a wedged process
    cancel: CancelFlag = field(default_factory=CancelFlag)
    lost: bool = False  # its lease was taken back: its outcome will be dropped
    finishing: bool = False  # its ending is being written: a heartbeat that misses it is no news
    ended: bool = False  # ended at its deadline while its handler ran on (a thread cannot be
    # killed): whatever the handler returns later is dropped
    key_lease: Any = None  # the API key lease held for it (harvest.coordination.Lease)
    key_fresh_until: float = 0.0  # monotonic: its key lease is surely live until then
    handler: Any = None  # stops an async handler while it runs (async_shell.Stop)
    handing_back: str | None = None  # why the worker stops it (shutdown)
    ran: bool = False  # its handler was started (a call with the key may have been made)
    tokens_used: int | None = None  # what the handler reported with ctx.used(tokens=...)
    announced: Announced | None = None  # the service's last rate-limit headers (ctx.observe)

    @classmethod
    def of(cls, pair: Pair, held: Held) -> Tracked:
        """A job this worker holds, as its hold read it: the attempt it will be, and how many
        it is allowed."""
        return cls(pair[0], pair[1], held.name, held.attempts + 1, max_attempts=held.max_attempts)

    @classmethod
    def begun(cls, pair: Pair, job: Started) -> Tracked:
        """A job this worker held and started in one write (:mod:`~harvest.execution.delivery`)."""
        return cls(pair[0], pair[1], job.name, job.attempt, job, job.max_attempts)

    @classmethod
    def taken(cls, pair: Pair, job: Held | Started) -> Tracked:
        """A job of a message as this worker took it: held (:meth:`of`), or held and started in
        one write (:meth:`begun`)."""
        return cls.begun(pair, job) if isinstance(job, Started) else cls.of(pair, job)

    def used(self, tokens: int) -> None:
        """The handler reports tokens its calls used (added up over the attempt)."""
        self.tokens_used = (self.tokens_used or 0) + tokens

    def observe(self, headers: Mapping[str, Any]) -> None:
        """The handler shows the service's answer: keep what its rate-limit headers say."""
        said = announced(headers)
        if said is not None:
            self.announced = said

    def settled_tokens(self) -> int | None:
        """What a key release settles the reservation with: nothing used when the handler
        never ran; what it reported; None (the reservation stands) when it reported nothing."""
        return self.tokens_used if self.ran else 0

    def key_renewed(self, sent_at: float, ttl: float) -> None:
        """A key lease request sent at ``sent_at`` (monotonic) succeeded for ``ttl`` seconds:
        the lease lives at least until the Redis clock has moved that far, which on this
        machine's clock is no earlier than ``sent_at + ttl`` (less a margin for drift)."""
        self.key_fresh_until = sent_at + ttl * (1 - KEY_MARGIN)

    def key_fresh(self, now: float) -> bool:
        """True when the key lease is surely still held, with no I/O: renewed recently, and
        this attempt neither lost nor ended. A paused process fails this on resume."""
        return not (self.lost or self.ended) and now < self.key_fresh_until


def key_still_held(tracked: Tracked, ttl: float) -> Generator[fx.Effect, Any, bool]:
    """Before a call with the key (``ctx.client()``, ``ctx.check_lease()``): no I/O while the
    lease was renewed lately; else it is renewed in Redis first. A process paused past its
    lease fails here and does not call; so does one whose Redis does not answer (it cannot
    tell whether the key is still its own). Driven by either shell."""
    now = yield fx.Clock()
    if tracked.key_fresh(now):
        return True
    lease = tracked.key_lease
    if lease is None or tracked.lost or tracked.ended:
        return False
    try:
        held = yield fx.RenewKey(lease)
    except away.REDIS_AWAY as exc:
        away.failed(exc, "checking a key lease before a call")
        return False
    away.answered()
    keys_renewed([(tracked, lease)], [held], now, ttl)
    return bool(held)


@dataclass(frozen=True, slots=True)
class Renewal:
    """What one heartbeat round renews."""

    jobs: list[Tracked]  # job leases to extend (one statement)
    keys: list[Tracked]  # of those, the ones holding a key lease (one round trip)
    wedged: list[Tracked]  # handlers past their deadline where nothing could stop them


def renewal(tracked: Iterable[Tracked], now: float) -> Renewal:
    """The leases a round renews: every job held or running, except those lost, ending or
    ended. ``wedged``: a blocking handler ran past its deadline (plus grace) where no signal
    reached it; the caller then renews nothing, so rescue takes the process's jobs back.

    Both shells renew the key leases first (Redis), then the job leases (one statement), and
    the keys whatever that statement does: a handler that runs holds its key and may call with
    it, so its key lease must not lapse while Postgres is away (a write there is tried for up
    to half the lease, :mod:`~harvest.execution.patience`); a key whose lease lapsed could go
    to another job and the service would see more calls on it than its concurrency."""
    every = list(tracked)
    jobs = [t for t in every if not (t.lost or t.finishing or t.ended)]
    wedged = [t for t in every if t.deadline <= now and not (t.finishing or t.ended)]
    return Renewal(jobs, [t for t in jobs if t.key_lease is not None], wedged)


def settle(
    jobs: Iterable[Tracked], held: Mapping[int, bool]
) -> tuple[list[Tracked], list[Tracked]]:
    """Apply a renewal statement's result (``{job id: cancel requested}`` of the leases still
    held): jobs missing from it are lost, unless they began to finish meanwhile (their own
    fenced write cleared the lease: no news); jobs whose cancellation was requested get
    ``cancel`` set. Returns (newly lost, newly cancelled).

    Nothing is logged here: a renewal can miss a row that this process itself ended in the
    meantime (a finish, a deferral, a cancellation seen at start), so "lost" is only known for
    sure where the outcome is dropped (:func:`report_lost`, called by the attempt)."""
    lost: list[Tracked] = []
    cancelled: list[Tracked] = []
    for job in jobs:
        if job.finishing or job.ended or job.lost:
            continue
        if job.job_id not in held:
            job.lost = True
            lost.append(job)
        elif held[job.job_id] and not job.cancel.is_set():
            job.cancel.set()
            cancelled.append(job)
    return lost, cancelled


def keys_renewed(
    keyed: Iterable[tuple[Tracked, Any]], renewed: Iterable[bool], sent_at: float, ttl: float
) -> None:
    """Apply a key renewal round's result (``keyed``: each job with the lease it held when the
    round was planned). A renewed lease is fresh again; one that was not is lost only if the
    job still holds it: a job whose handler ended meanwhile gave its key back (the release
    deleted the lease), which is no news and no warning."""
    for (job, lease), ok in zip(keyed, renewed, strict=True):
        if ok:
            job.key_renewed(sent_at, ttl)
        elif job.key_lease is lease:
            log.warning("key lease on key %s of pool %r was lost", lease.key_id, lease.pool)


def report_lost(job: Tracked, *, waiting: bool = False) -> None:
    """Log once, where it happens, that an attempt's outcome is dropped: its lease was taken
    back (rescued after a pause or cut-off) and its fenced write matched nothing or was not
    tried."""
    if waiting:
        log.warning(
            "job %s: lease lost while it waited its turn (taken back after a pause or cut-off); "
            "it was not started here",
            job.job_id,
        )
        return
    log.warning(
        "job %s attempt %s: lease lost while running (taken back after a pause or cut-off); "
        "its outcome was dropped",
        job.job_id,
        job.attempt,
    )
