"""A key lease passed from one job of a process to the next, with no Redis round trip.

A key bound by its concurrency alone (no rate limit, token budget, learned limit or
announcement at its grant: ``Lease.plain``) can go from a job that ends to the next job of the
same pool as it is: the key's load stays one call of this process, so no key is ever over its
concurrency, and the release and the next lease (two scripts, a round trip) are saved. The
decision is pure (:func:`passable`, :func:`takes_over`), shared by both shells: the blocking
shell passes a lease to the next job of its message (``SyncShell.release_then_lease``) and,
through :class:`Parking`, to the first job of the next message that asks within :data:`PARK`
seconds; the asyncio shell to a job of this process waiting for the pool or, through
:class:`Parking`, to one that asks within :data:`PARK` seconds.

A key that answers 429 or is refused in this process stops its older leases here from passing
(:class:`Faults`): each goes back to Redis, which knows the key cools, is disabled or has had
its limits lowered, instead of passing on for the rest of its :data:`PASS_FOR`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from harvest.coordination.key_state import Lease
from harvest.execution import effects as fx
from harvest.execution.tracking import KEY_MARGIN

PASS_FOR = 1.0  # seconds after its grant a plain key lease may pass from job to job
PARK = 0.05  # seconds a lease that may pass waits in its process for a job of its pool


@dataclass(slots=True)
class Fault:
    until: float | None = None  # the end of the cooldown a 429 began, Redis clock


class Faults:
    """The keys that answered 429 or were refused in this process, each with the time (Redis
    clock) a lease of it must have been granted at or after to pass on. For a 429 that is the
    end of the cooldown it began (Redis grants the key to nobody before, so every lease of it
    granted earlier was granted before the 429, and none after is held back); for a refusal,
    or a cooldown whose end Redis did not say, a lease TTL past this process's clock. While a
    fault is being written to Redis, no lease of its key passes at all. One per process, shared
    by its jobs (:class:`~harvest.gate.Gate`): a fault's changes are made under a lock (a
    thread pool's jobs may fault one key at once, and a fault is rare); checking a lease is
    two reads."""

    def __init__(self) -> None:
        self._after: dict[tuple[str, int], float] = {}
        self._writing: collections.Counter[tuple[str, int]] = collections.Counter()
        self._lock = threading.Lock()  # a thread pool's jobs may fault the same key at once

    @contextlib.contextmanager
    def writing(self, lease: Lease, ttl: float) -> Iterator[Fault]:
        """The key of ``lease`` answered 429 or was refused: around writing that to Redis.
        Set ``until`` on what it gives: the end of the cooldown the write began (Redis clock),
        when Redis said."""
        key, fault = (lease.pool, lease.key_id), Fault()
        with self._lock:
            self._writing[key] += 1
        try:
            yield fault
        finally:
            now = time.time()
            after = fault.until if fault.until is not None else now + ttl
            with self._lock:
                self._after[key] = max(after, self._after.get(key, -math.inf))
                for old in [k for k, t in self._after.items() if t < now - PASS_FOR - ttl]:
                    del self._after[old]  # every lease granted before it is too old to pass
                self._writing[key] -= 1
                if self._writing[key] <= 0:
                    del self._writing[key]

    def clear(self, lease: Lease) -> bool:
        """Whether ``lease`` was granted after every fault of its key seen in this process."""
        key = (lease.pool, lease.key_id)
        return key not in self._writing and lease.granted_at >= self._after.get(key, -math.inf)


def passable(done: fx.ReleaseKey, now: float, ttl: float, *, faults: Faults) -> bool:
    """Whether a key lease given back may pass as it is to another job of this process,
    without going back to Redis and being leased again: the key is bound by its concurrency
    alone (at its grant it had no rate limit, token budget, learned limit or announcement:
    ``plain``), the job before succeeded (a 429 ends its attempt otherwise, and its key
    cools), its call counted no tokens, and the lease is young (:func:`young`). The key's load
    stays what it was, one call of this process. What the process does not see is a cooldown
    or a disable another process or an operator puts on the key meanwhile: it may still be used
    until the lease is no longer young, :data:`PASS_FOR` after its grant at most, as a job
    that leased it just before would; what this process sees (a 429 or a refusal of the key:
    ``faults``) stops the leases of the key it holds from passing at once."""
    lease = done.lease
    return (
        lease.plain
        and young(lease, now, ttl, faults=faults)
        and done.succeeded
        and lease.cost == 0
        and not done.used
        and done.announced is None
    )


def young(lease: Lease, now: float, ttl: float, *, faults: Faults) -> bool:
    """Whether a job may take ``lease`` over as freshly leased (``now``: the epoch): within
    :data:`PASS_FOR` of its grant on the Redis clock (and half of the key margin of the TTL,
    should that be less). The job trusts it for the TTL less the margin from now
    (:data:`~harvest.execution.tracking.KEY_MARGIN`), which its expiry in Redis, at least the
    grant plus the TTL, then still covers; a process paused past that asks Redis again. A
    clock behind Redis's (a negative age) passes nothing: a skewed clock can make passing
    rarer, never longer. A lease granted before a 429 or refusal of its key in this process
    (:class:`Faults`) is never young."""
    age = now - lease.granted_at
    return 0.0 <= age <= min(PASS_FOR, ttl * KEY_MARGIN / 2) and faults.clear(lease)


def takes_over(
    lease: Lease, pool: str, cost: int, now: float, ttl: float, *, faults: Faults
) -> bool:
    """Whether a job asking for a key of ``pool`` with ``cost`` tokens may take over
    ``lease``, a :func:`passable` one given back by a job before it."""
    return lease.pool == pool and cost == 0 and young(lease, now, ttl, faults=faults)


def passes_on(
    done: fx.ReleaseKey, pool: str, cost: int, now: float, ttl: float, *, faults: Faults
) -> bool:
    """Whether the key ``done`` gives back passes to the job asking for a key of ``pool``
    with ``cost`` tokens (the next job of a sync message; an async job that waits, or comes
    soon after), with no Redis round trip."""
    return passable(done, now, ttl, faults=faults) and takes_over(
        done.lease, pool, cost, now, ttl, faults=faults
    )


class Parking:
    """Key leases given back that may pass on (:func:`passable`), by pool, oldest first, each
    with the time it goes back to Redis through ``give_back`` when no job of its pool took it
    over within :data:`PARK` seconds. The decisions are one for both shells; what differs is
    given: ``later(delay, fn)`` calls ``fn`` after ``delay`` seconds (the asyncio shell: its
    loop's ``call_later``; the blocking shell: its watchdog thread), and ``give_back`` sends a
    lease back without waiting on it (the asyncio shell: a task) or in the caller's thread (the
    blocking shell). Safe to use from several threads: a blocking process's timer thread gives
    back what its job thread parked."""

    def __init__(
        self,
        give_back: Callable[[fx.ReleaseKey], None],
        ttl: float,
        faults: Faults,
        later: Callable[[float, Callable[[], None]], Any],
    ) -> None:
        self._give_back, self.ttl, self.faults, self._later = give_back, ttl, faults, later
        self._parked: dict[str, collections.deque[tuple[fx.ReleaseKey, float]]] = {}
        self._timers: set[str] = set()  # pools with a timer to give back what waited out
        self._lock = threading.Lock()

    def park(self, done: fx.ReleaseKey) -> None:
        pool = done.lease.pool
        with self._lock:
            self._parked.setdefault(pool, collections.deque()).append(
                (done, time.monotonic() + PARK)
            )
            if pool in self._timers:
                return
            self._timers.add(pool)
        self._later(PARK, lambda: self._expire(pool))

    def take(self, pool: str, cost: int) -> Lease | None:
        """A lease of ``pool`` a job asking for ``cost`` tokens may take over (the newest
        first); those too old to pass go back to Redis."""
        if cost:
            return None  # no lease passes to a job that reserves tokens
        old: list[fx.ReleaseKey] = []
        taken: Lease | None = None
        now = time.time()
        with self._lock:
            parked = self._parked.get(pool)
            while parked:
                done, _ = parked.pop()
                if takes_over(done.lease, pool, cost, now, self.ttl, faults=self.faults):
                    taken = done.lease
                    break
                old.append(done)
        self._send_back(old)
        return taken

    def drop_key(self, lease: Lease) -> None:
        """The key of ``lease`` answered 429 or was refused: what is parked of it goes back
        (to Redis, which knows the key cools or is disabled) instead of passing on."""
        with self._lock:
            parked = self._parked.get(lease.pool)
            dropped = [e for e in parked or () if e[0].lease.key_id == lease.key_id]
            for entry in dropped:
                assert parked is not None
                parked.remove(entry)
        self._send_back([done for done, _ in dropped])

    def drain(self) -> None:
        """Every parked lease back to Redis now (shutdown)."""
        with self._lock:
            back = [done for parked in self._parked.values() for done, _ in parked]
            self._parked.clear()
        self._send_back(back)

    def _expire(self, pool: str) -> None:
        now = time.monotonic()
        back: list[fx.ReleaseKey] = []
        with self._lock:
            self._timers.discard(pool)
            parked = self._parked.get(pool)
            while parked and parked[0][1] <= now:
                back.append(parked.popleft()[0])
            again = parked[0][1] - now if parked else None
            if again is not None:
                self._timers.add(pool)
        self._send_back(back)
        if again is not None:
            self._later(again, lambda: self._expire(pool))

    def _send_back(self, back: list[fx.ReleaseKey]) -> None:
        for done in back:
            self._give_back(done)
