"""Backpressure: the most pending jobs a queue (and, optionally, a job name) may hold.

Counting a queue of a million rows on every enqueue would cost more than the enqueue, so each
process keeps the last exact count of each limit it enforces, plus what it admitted since:

* far from the limit (that count is younger than :data:`FRESH` seconds and, with the new jobs,
  stays under :data:`FAST_FRACTION` of the limit) the enqueue takes the limit's Postgres
  advisory lock in *shared* mode and does not count;
* otherwise it takes the lock *exclusively*, which waits for every enqueue in flight on that
  limit in any process (shared holders included), counts exactly, and admits what fits.

Exactness: counted admissions never overshoot, together or alone, and one process never
overshoots. Several processes can overshoot only through their uncounted (fast) admissions,
which each process allows only while its own count, at most one second old, stays under 90 %
of the limit: the depth exceeds the limit only if the other processes enqueue more than 10 % of
it within one second, and then by at most what they enqueued in that second.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import Connection

from harvest import store
from harvest.errors import JobDepthFull, QueueFull

FRESH = 1.0  # seconds a count is trusted for
FAST_FRACTION = 0.9  # below this share of a limit, recent counts are trusted


@dataclass(frozen=True, slots=True)
class Limit:
    """One bound on pending jobs: of a queue (``job`` None) or of one job name."""

    queue: str
    limit: int
    job: str | None = None

    @property
    def key(self) -> str:
        return f"job:{self.job}" if self.job is not None else f"queue:{self.queue}"

    def full(self, depth: int) -> QueueFull:
        if self.job is not None:
            return JobDepthFull(self.job, self.queue, depth, self.limit)
        return QueueFull(self.queue, depth, self.limit)


@dataclass(slots=True)
class Admission:
    """Room under each limit for one transaction (at least the demand when not counted).
    Say what was inserted with :meth:`took`."""

    room: dict[Limit, int]
    depth: dict[Limit, int]  # empty when not counted (the fast path)
    counted_at: float = 0.0
    taken: dict[Limit, int] | None = None

    @property
    def counted(self) -> bool:
        return bool(self.depth)

    def fits(self, demands: Mapping[Limit, int]) -> bool:
        return all(self.room[lim] >= n for lim, n in demands.items())

    def most(self, n: int) -> int:
        """How many of ``n`` jobs that each count against every limit fit."""
        return max(0, min([n, *self.room.values()]))

    def took(self, taken: Mapping[Limit, int]) -> None:
        self.taken = dict(taken)

    def refusal(self, demands: Mapping[Limit, int] | None = None) -> QueueFull:
        """The error for the first limit without room (for ``demands``, or for one more job)."""
        ordered = sorted(self.room, key=lambda x: x.key)
        for lim in ordered:
            if self.room[lim] < (demands[lim] if demands is not None else 1):
                return lim.full(self.depth.get(lim, lim.limit))
        return ordered[0].full(self.depth.get(ordered[0], ordered[0].limit))


@dataclass(slots=True)
class _Count:
    depth: int  # pending jobs counted at ``at``, plus what this process admitted since
    at: float


@dataclass(slots=True)
class DepthGauge:
    """Per-process admission control (see the module's docstring). Thread-safe.

    Within a process it is exact: a fast admission is never decided while an exact one of the
    same limit is in flight in this process, and an exact count leaves room for the fast
    admissions still in flight (decided, not yet inserted)."""

    _counts: dict[str, _Count] = field(default_factory=dict)
    _fast_in_flight: Counter[str] = field(default_factory=Counter)
    _exact_in_flight: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def admit(self, conn: Connection, demands: Mapping[Limit, int]) -> Iterator[Admission]:
        """Take the depth locks of ``demands`` ({limit: jobs}) until the transaction ends and
        yield the room each has; call :meth:`Admission.took` with what was inserted."""
        limits = sorted(demands, key=lambda lim: lim.key)
        fast = self._decide(demands)
        admission: Admission | None = None
        try:
            if fast:
                for lim in limits:
                    store.lock_depth(conn, lim.key, exclusive=False)
                admission = Admission(room=dict(demands), depth={})
            else:
                admission = self._count(conn, limits)
            yield admission
        finally:
            self._done(demands, fast, admission)

    @contextmanager
    def trusted(self, demands: Mapping[Limit, int]) -> Iterator[list[str] | None]:
        """The fast path alone, for a caller that takes the locks in its own statement: when
        the cached counts admit ``demands`` without counting, yield the keys whose depth locks
        it must take *shared* (sorted, :func:`harvest.store.lock_depth`'s keys) before it
        inserts, in the same transaction; otherwise yield None and register nothing (the
        caller then goes through :meth:`admit`)."""
        if not self._decide(demands, exact=False):
            yield None
            return
        try:
            yield sorted(lim.key for lim in demands)
        finally:
            self._done(demands, True, None)

    def _decide(self, demands: Mapping[Limit, int], *, exact: bool = True) -> bool:
        """Fast (trust the cached count) or exact; registers this admission as in flight (an
        exact one only with ``exact``)."""
        now = time.monotonic()
        with self._lock:
            fast = all(
                (count := self._counts.get(lim.key)) is not None
                and now - count.at <= FRESH
                and not self._exact_in_flight[lim.key]
                and count.depth + n <= FAST_FRACTION * lim.limit
                for lim, n in demands.items()
            )
            for lim, n in demands.items():
                if fast:
                    self._counts[lim.key].depth += n  # reserved
                    self._fast_in_flight[lim.key] += n
                elif exact:
                    self._exact_in_flight[lim.key] += 1
        return fast

    def _count(self, conn: Connection, limits: list[Limit]) -> Admission:
        depth: dict[Limit, int] = {}
        counted_at = time.monotonic()
        for lim in limits:
            store.lock_depth(conn, lim.key, exclusive=True)
            depth[lim] = store.pending_depth(conn, lim.key)
        with self._lock:  # fast admissions decided before our lock was granted, not yet in
            in_flight = {lim: self._fast_in_flight[lim.key] for lim in limits}
        room = {lim: max(0, lim.limit - depth[lim] - in_flight[lim]) for lim in limits}
        depth = {lim: depth[lim] + in_flight[lim] for lim in limits}
        return Admission(room=room, depth=depth, counted_at=counted_at)

    def _done(self, demands: Mapping[Limit, int], fast: bool, admission: Admission | None) -> None:
        """Record the end of an admission. A failed fast one keeps its reservation (safe: the
        count is then high until the next exact count, at most a second away)."""
        with self._lock:
            for lim, n in demands.items():
                if fast:
                    self._fast_in_flight[lim.key] -= n
                    continue
                self._exact_in_flight[lim.key] -= 1
                if admission is None or not admission.counted:
                    continue
                taken = (admission.taken or {}).get(lim, 0)
                current = self._counts.get(lim.key)
                if current is None or admission.counted_at > current.at:
                    depth = admission.depth[lim] + taken
                    self._counts[lim.key] = _Count(depth, admission.counted_at)
                else:  # a later count is installed; it may miss these rows: add them (safe)
                    current.depth += taken

    def forget(self) -> None:
        with self._lock:
            self._counts.clear()
