"""A message's sync jobs, run one after another in one thread, their writes shared where they
meet.

A prefork child (or ``-P solo``) runs a message's jobs one after another, so each job's fenced
start and finish would be a statement of its own: a round trip and a commit each, the most of
the process's and Postgres's time per short job. Two ways to share them, both bounded:

- **The next job begun ahead** (:class:`Ahead`): when a job yields its Finish, the next job is
  driven through what it may do ahead (:data:`AHEAD`: its rate permit and key lease; the key of
  the job before is given back in the same round trip, or passes to it), and if it then asks
  for its Start, both go in one statement.
- **A window of short jobs** (:class:`Message`; the rule: :mod:`~harvest.execution.windows`):
  where the jobs after it are known to be short (their handlers' recent run times add up to at
  most the write linger, ``HARVEST_WRITE_LINGER_MS``) and need no key, or a key of the pool of
  the key the window's first job took, bound by its concurrency alone (lent along the window:
  its jobs run one after another, so it stays one call of this process; :meth:`Message._begin`),
  they start in that same statement, and their finishes wait for one another, each at most as
  long as a finish waits for company elsewhere (:func:`~.grouping.finish_linger`), to go with
  the next window's starts. A message of 16 no-op jobs takes two statements instead of
  seventeen. Jobs of unknown or longer run time are begun one ahead as above, and a job's
  finish never waits on a job whose run time is not known to fit.
- **Held and started in one write** (:func:`~harvest.execution.windows.at_hold`): a message's
  first job, when it needs nothing of the gate (or only a key, found at once), and the short
  ones after it as in a window: one row write each where a hold then a start were two (as
  :mod:`~harvest.execution.delivery` does for async jobs).

What a crash costs is bounded by the same linger: jobs started ahead and not yet run, and
finishes not yet written, all within milliseconds of their handlers' expected run times. Both
come back by rescue, as a single job's do. A message that ends early (a job raised out of it, or
the process is stopping) writes the finishes it holds and hands the jobs started ahead (in a
window or with their hold) back to pending with their attempt refunded (:meth:`Message.close`).

The decisions stay the core's (:mod:`harvest.execution.core`): each attempt says what it does
first; this module only chooses which of their writes share a statement.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harvest.coordination.key_state import Lease
from harvest.execution import delivery, grouping, handoff, sql
from harvest.execution import effects as fx
from harvest.execution.windows import MAX_WINDOW, joins
from harvest.jobs import Started

if TYPE_CHECKING:
    from harvest.app import JobSpec
    from harvest.execution.sync_shell import SyncShell

log = logging.getLogger("harvest.runner")

# What the next job may do ahead, while the job before it ends: no waiting, no write to
# Postgres (its rate permit and key lease: the key of the job before is already released).
AHEAD = (fx.Clock, fx.RatePermit, fx.LeaseKey, fx.LoadPool)
ENDED_EARLY = "the message ended before its turn"
KEY_GIVEN_BACK = "the key it was lent along its window went back to Redis before its turn"
Attempt = Generator[fx.Effect, Any, Any]
# a job of a message: held; held and started; or that with a key leased first (delivery.Keyed)
Taken = tuple[sql.Pair, "sql.Held | Started | delivery.Keyed"]


@dataclass(slots=True)
class Paused:
    """An attempt driven up to an effect not yet performed, or to its end."""

    effect: fx.Effect | None = None
    done: bool = False
    returned: Any = None


class Abandoned(Exception):
    """Thrown into an attempt begun ahead whose turn never came."""


def caught(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """``fn(*args)`` as (value, None), or (None, what it raised): for throwing into an attempt."""
    try:
        return fn(*args), None
    except BaseException as exc:
        return None, exc


class Ahead:
    """A job of a message begun before its turn: driven up to its first effect that may not go
    ahead (``strict``: its first effect other than the clock: no permit or key taken early;
    but for the key ``chain``, when it may take it over: see :class:`Message`). Its turn goes
    on from there; ``result`` is that effect's, if it was performed with the job before's
    write."""

    def __init__(self, gen: Attempt, *, strict: bool = False, chain: Lease | None = None) -> None:
        self.gen = gen
        self.strict = strict
        self.chain = chain  # the key of the job before it in its window, lent to it
        self.release: fx.ReleaseKey | None = None  # the job before's key, given back with
        # this one's lease (one round trip), or alone before that job's Finish
        self.lease: Lease | None = None  # the key it took: leased, or ``chain`` borrowed
        self.at = Paused()
        self.result: tuple[Any, BaseException | None] | None = None  # of ``at.effect``, if done
        self.raised: BaseException | None = None

    @property
    def borrowed(self) -> Lease | None:
        """The key it was lent and holds (the window's: given back by its last holder only)."""
        return self.lease if self.chain is not None else None

    def begin(self, shell: SyncShell) -> None:
        """Drive it up to its first effect that may not go ahead; what it raised is raised in
        its own turn."""
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                self.at = shell.advance(self.gen, value, error, stop=self._stops)
                e = self.at.effect
                if self.at.done:
                    return
                if isinstance(e, fx.LeaseKey) and not self.strict:
                    done, self.release = self.release, None
                    if done is not None:
                        value, error = caught(shell.release_then_lease, done, e)
                    else:
                        value, error = caught(shell.perform, e)
                    if isinstance(value, Lease):
                        self.lease = value
                elif isinstance(e, fx.LeaseKey) and self._borrows(shell, e):
                    self.lease = value = self.chain
                    error = None
                elif isinstance(e, fx.ReleaseKey) and self.borrowed is not None:
                    self.lease = value = error = None  # lent: its last holder gives it back
                else:
                    return
        except Exception as exc:
            self.raised = exc

    def _borrows(self, shell: SyncShell, e: fx.LeaseKey) -> bool:
        chain = self.chain
        return (
            chain is not None
            and self.lease is None
            and handoff.takes_over(
                chain, e.pool, e.cost, time.time(), shell.plan.lease_ttl, faults=shell.gate.faults
            )
        )

    def _stops(self, e: fx.Effect) -> bool:
        if self.strict:
            return not isinstance(e, fx.Clock)
        return not isinstance(e, AHEAD) or isinstance(e, fx.LeaseKey)

    @property
    def start(self) -> fx.Start | None:
        """The Start it waits at, if that is where it was driven to."""
        e = self.at.effect
        return e if isinstance(e, fx.Start) and not self.at.done and self.raised is None else None


@dataclass(slots=True)
class Parked:
    """A job that ended, paused at its Finish until the statement it shares is written."""

    gen: Attempt
    finish: fx.Finish
    until: float  # monotonic: the latest its write should wait


class Message:
    """A message's held jobs run one after another in this thread (see the module's text)."""

    def __init__(
        self,
        shell: SyncShell,
        attempts: Sequence[Attempt],
        specs: Sequence[JobSpec | None],
        jobs: Sequence[Taken],
    ) -> None:
        self.shell = shell
        self.attempts = attempts
        self.specs = specs
        self.jobs = jobs
        self.turn = 0  # the next job whose turn has not begun
        self.begun: dict[int, Ahead] = {}
        self.lent: dict[int, Lease] = {}  # job -> the key of the job before it, lent to it
        self.given_back: set[str] = set()  # tokens of lent keys that went back to Redis
        self.parked: list[Parked] = []
        self.counts: Counter[str] = Counter()
        self.linger, self.settle = shell.lingers
        for j in range(1, len(jobs)):  # a key leased first, lent along the jobs started with it
            now, before = jobs[j][1], jobs[j - 1][1]
            if (
                isinstance(now, delivery.Keyed)
                and isinstance(before, delivery.Keyed)
                and now.lease.token == before.lease.token
            ):
                self.lent[j] = now.lease

    def run(self) -> Counter[str]:
        for i in range(len(self.attempts)):
            self._turn(i)
        self._write([], [])
        return self.counts

    # --- a job's turn ---------------------------------------------------------------------

    def _turn(self, i: int) -> None:
        gen, shell = self.attempts[i], self.shell
        self.turn = i + 1
        begun = self.begun.pop(i, None)
        lent = self.lent.pop(i, None)
        if self.parked and not (self._started(i, begun) and self._may_wait(i)):
            self._write([], [])  # it may run long: the ends waiting for it go now
        if lent is not None and lent.token in self.given_back:
            # the key it was lent went back to Redis (the job before failed, or was slow): it
            # never runs on it, and goes back to pending as a job started ahead does
            if begun is not None:
                self.counts["deferred"] += self._hand_back([(i, begun)], KEY_GIVEN_BACK)
            else:  # started with its hold
                self.counts["deferred"] += self._hand_back([], KEY_GIVEN_BACK, also=[i])
            return
        value: Any = None
        error: BaseException | None = None
        if begun is not None:
            if begun.raised is not None:
                raise begun.raised
            if begun.at.done:
                self.counts.update(begun.at.returned)
                return
            value, error = begun.result or caught(shell.perform, begun.at.effect)
        last = i + 1 == len(self.attempts)
        release: fx.ReleaseKey | None = None  # this job's key, kept for the next job's lease

        def stops(e: fx.Effect) -> bool:  # its Finish; its key's release, kept for the next
            return isinstance(e, fx.Finish) or (  # or for the next, to whom it is lent
                isinstance(e, fx.ReleaseKey)
                and not last
                and (i + 1 not in self.begun or i + 1 in self.lent)
            )

        try:
            while True:
                at = shell.advance(gen, value, error, stop=stops)
                if at.done:
                    self.counts.update(at.returned)
                    return
                if isinstance(at.effect, fx.ReleaseKey):
                    if release is not None:
                        shell.perform(release)  # (a job holds one key: none, in fact)
                    if i + 1 in self.lent:
                        self._pass_on(at.effect, self.lent[i + 1])
                        value, error = None, None
                        continue
                    release, value, error = at.effect, None, None
                    continue
                assert isinstance(at.effect, fx.Finish)
                # parked, or written and gone on to its end: either way its turn is over
                release = self._ended(i, gen, at.effect, release)
                return
        finally:
            if release is not None:
                shell.perform(release)

    def _ended(
        self,
        i: int,
        gen: Attempt,
        e: fx.Finish,
        release: fx.ReleaseKey | None,
    ) -> fx.ReleaseKey | None:
        """Job ``i`` asks for its Finish: park it, or write it (with what is parked, and the
        starts of the jobs begun ahead now). Returns the key release still kept."""
        until = time.monotonic() + grouping.finish_linger(self.linger, self.settle, e.ran)
        self.parked.append(Parked(gen, e, until))
        nxt = self.begun.get(i + 1)
        if nxt is not None or self._at_hold(i + 1):  # within a window: the next job started
            if release is not None:  # it took no key (a window's jobs need none): free it now
                self.shell.perform(release)
            if not (self._started(i + 1, nxt) and self._may_wait(i + 1)):
                self._write([], [])
            return None
        window: list[Ahead] = []
        if i + 1 < len(self.attempts):
            window = self._begin(i + 1, release)
            release = None
        self._write(window, [a.start for a in window if a.start is not None])
        return release

    def _pass_on(self, done: fx.ReleaseKey, lent: Lease) -> None:
        """A job gives back the key it lent to the next job of its window: it passes on as it
        is (:func:`~harvest.execution.handoff.passable`: the call succeeded, the lease is young,
        no fault of the key seen here), or it goes back to Redis, and the jobs it was lent to
        go back to pending in their turns, unrun."""
        shell = self.shell
        now, ttl = time.time(), shell.plan.lease_ttl
        if done.lease.token == lent.token and handoff.passable(
            done, now, ttl, faults=shell.gate.faults
        ):
            shell.gate.reused(lent)
            return
        self.given_back.add(lent.token)
        shell.perform(done)

    def _started(self, j: int, begun: Ahead | None) -> bool:
        """Whether job ``j`` (``begun``: begun ahead as that) was started before its turn: with
        its hold, or in the statement that ended the job before it."""
        if self._at_hold(j):
            return True
        return begun is not None and begun.start is not None and begun.result is not None

    def _at_hold(self, j: int) -> bool:
        """Whether job ``j`` was held and started in one write (:func:`~.windows.at_hold`)."""
        return j < len(self.jobs) and isinstance(self.jobs[j][1], Started | delivery.Keyed)

    def _may_wait(self, j: int) -> bool:
        """Whether the finishes parked may wait for job ``j`` to run: its run time is known and
        ends before the soonest of their waits is over."""
        spec = self.specs[j]
        ran = self.shell.run_times.of(spec.name) if spec is not None else None
        if ran is None or not self.parked:
            return False
        return time.monotonic() + ran <= min(p.until for p in self.parked)

    # --- a window -------------------------------------------------------------------------

    def _begin(self, j: int, release: fx.ReleaseKey | None) -> list[Ahead]:
        """Begin job ``j`` ahead (given the key ``release`` of the job before, for its lease)
        and, where job ``j`` asks for its Start, the short jobs after it whose run times fit in
        the write linger: keyless ones, and those of job ``j``'s pool while its key may pass
        from job to job (``plain``: bound by its concurrency alone), lent it. Returns those of
        them that ask for their Start, in order.

        A key lent along a window stays one call of this process at a time (its jobs run one
        after another), so it is never over its concurrency; each job gives it to the next as
        a passed lease would go (:meth:`_pass_on`), and where it may not (a 429, a fault, an
        old lease) it goes back to Redis and the rest of the window is handed back unrun."""
        first = Ahead(self.attempts[j])
        first.release = release
        first.begin(self.shell)
        if first.release is not None:  # it took no key: the key is free before the write
            done, first.release = first.release, None
            self.shell.perform(done)
        self.begun[j] = first
        ids = {p.finish.row.job_id for p in self.parked}
        if first.start is None or first.start.job_id in ids:
            return []  # (a job twice in a message: its start waits for its own turn)
        window = [first]
        ids.add(first.start.job_id)
        spent = self._run_time(j)
        key = first.lease if first.lease is not None and first.lease.plain else None
        k = j + 1
        while spent is not None and k < len(self.attempts) and len(window) < MAX_WINDOW:
            ran = self._run_time(k)
            if ran is None or not joins(spent, ran, self.linger):
                break
            if self._keyless(k):
                ahead = Ahead(self.attempts[k], strict=True)
            elif key is not None and delivery.leases_from(self.specs[k], key.pool):
                ahead = Ahead(self.attempts[k], strict=True, chain=key)
            else:
                break
            ahead.begin(self.shell)
            self.begun[k] = ahead
            if ahead.borrowed is not None:
                self.lent[k] = ahead.borrowed
            key = ahead.borrowed
            start = ahead.start
            if start is None or start.job_id in ids:
                break
            ids.add(start.job_id)
            window.append(ahead)
            spent += ran
            k += 1
        return window

    def _run_time(self, j: int) -> float | None:
        spec = self.specs[j]
        return self.shell.run_times.of(spec.name) if spec is not None else None

    def _keyless(self, j: int) -> bool:
        spec = self.specs[j]
        return spec is not None and spec.pool is None

    # --- the shared statement -------------------------------------------------------------

    def _write(self, window: Sequence[Ahead], starts: Sequence[fx.Start | None]) -> None:
        """One statement: the parked finishes and the starts of ``window``; then each parked
        job goes on to its end. Where it fails (Postgres away past the write's patience), the
        error goes into each parked job, as into a finish written alone, and each start is left
        for its job's turn."""
        parked, self.parked = self.parked, []
        if not parked:
            return
        shell, plan = self.shell, self.shell.plan
        rows = [p.finish.row for p in parked]
        pairs = [(s.job_id, s.token) for s in starts if s is not None]
        finished: set[int] = set()
        if pairs:
            query = sql.finish_then_start(rows, pairs, ttl=plan.lease_ttl, worker=plan.worker)
            answer, error = caught(shell.db, query)
            if error is None:
                finished, started = answer
                for ahead in window:
                    if ahead.start is not None:
                        ahead.result = (started.get(ahead.start.job_id), None)
        else:
            answer, error = caught(shell.writer.write, "finish", rows)
            if error is None:
                finished = {row.job_id for row, ok in zip(rows, answer, strict=True) if ok}
        raised: BaseException | None = None
        for p in parked:  # each goes on to its end, even where one before it raised
            value = p.finish.row.job_id in finished if error is None else None
            try:
                self.counts.update(shell.advance(p.gen, value, error).returned)
            except BaseException as exc:
                raised = raised or exc
        if raised is not None:
            raise raised

    # --- leaving --------------------------------------------------------------------------

    def close(self) -> None:
        """The message ends, early or not: the finishes still parked are written, and jobs
        begun ahead whose turn will not come give back what they took. Those started ahead go
        back to pending at once with their attempt refunded (they never ran); any other stays
        held until its lease expires and rescue takes it back, as when a worker dies."""
        try:
            self._write([], [])
        except Exception as exc:
            log.warning("finishes of a message's jobs not written (%s)", type(exc).__name__)
        begun = list(self.begun.items())
        self.begun.clear()
        at_hold = [j for j in range(self.turn, len(self.jobs)) if self._at_hold(j)]
        self._hand_back(begun, ENDED_EARLY, also=at_hold)  # started with their hold: not run

    def _hand_back(
        self, begun: Sequence[tuple[int, Ahead]], reason: str, also: Sequence[int] = ()
    ) -> int:
        """Jobs begun ahead whose turn will not come (or must not run), and jobs ``also``
        started with their hold: each gives back what it took (:meth:`_abandon`), and those
        started go back to pending in one write, their attempt refunded (they never ran).
        Returns how many were started (and are handed back). A key leased first for jobs
        ``also`` goes back to Redis, once, unless it went back already."""
        back = [sql.Defer(*self.jobs[j][0], 0.0, reason, started=True) for j in also]
        for j in also:
            self.attempts[j].close()  # never begun: nothing to wind down
            job = self.jobs[j][1]
            if isinstance(job, delivery.Keyed) and job.lease.token not in self.given_back:
                self.given_back.add(job.lease.token)
                caught(self.shell.perform, fx.ReleaseKey(job.lease, used=0))
        for j, ahead in begun:
            start, result = ahead.start, ahead.result
            if start is not None and result is not None and isinstance(result[0], Started):
                back.append(sql.Defer(*self.jobs[j][0], 0.0, reason, started=True))
            self._abandon(ahead)
        if back:
            try:
                self.shell.writer.write("defer", back)
            except Exception as exc:
                log.warning("jobs started ahead not handed back (%s): rescue takes them back "
                            "when their leases expire", type(exc).__name__)  # fmt: skip
        return len(back)

    def _abandon(self, ahead: Ahead) -> None:
        """:class:`Abandoned` is thrown into a job begun ahead, so it gives back what it took:
        its key lease; a key lent along its window goes back to Redis once, by the first of
        them (the one that held it when the message ended), unless it went back already."""
        if ahead.raised is not None or ahead.at.done:
            return
        lent = ahead.borrowed
        if lent is not None and lent.token not in self.given_back:
            self.given_back.add(lent.token)
            lent = None  # it holds the key now: it gives it back

        def swallowed(e: fx.Effect) -> bool:
            return lent is not None and isinstance(e, fx.ReleaseKey)

        value: Any = None
        error: BaseException | None = Abandoned(ENDED_EARLY)
        try:
            while not self.shell.advance(ahead.gen, value, error, stop=swallowed).done:
                value, error = None, None  # a lent key: its holder gives it back
        except Abandoned:
            pass
        except Exception as exc:
            log.warning("a job begun ahead was not wound down (%s)", type(exc).__name__)
