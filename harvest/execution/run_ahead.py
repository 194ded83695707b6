"""A message's sync jobs, run one after another in one thread, their writes shared where they
meet.

A prefork child (or ``-P solo``) runs a message's jobs one after another, so each job's fenced
start and finish would be a statement of its own: a round trip and a commit each, the most of
the process's and Postgres's time per short job. Two ways to share them, both bounded:

- **The next job begun ahead** (:class:`Ahead`): when a job yields its Finish, the next job is
  driven through what it may do ahead (:data:`AHEAD`: its rate permit and key lease; the key of
  the job before is given back in the same round trip, or passes to it), and if it then asks
  for its Start, both go in one statement.
- **A window of short jobs** (:class:`Message`): where the jobs after it are known to be short
  (their handlers' recent run times, :class:`RunTimes`, add up to at most the write linger,
  ``HARVEST_WRITE_LINGER_MS``) and need no key, they start in that same statement, and their
  finishes wait for one another, each at most as long as a finish waits for company elsewhere
  (:func:`~harvest.execution.grouping.finish_linger`), to go with the next window's starts. A
  message of 16 no-op jobs takes two statements instead of seventeen. Jobs of unknown or
  longer run time are begun one ahead as above, and a job's finish never waits on a job whose
  run time is not known to fit.
- **Held and started in one write** (:func:`at_hold`): a message's first job, when it needs
  nothing of the gate, and the short ones after it as in a window: one row write each where a
  hold then a start were two (as :mod:`~harvest.execution.delivery` does for async jobs).

What a crash costs is bounded by the same linger: jobs started ahead and not yet run, and
finishes not yet written, all within milliseconds of their handlers' expected run times. Both
come back by rescue, as a single job's do. A message that ends early (a job raised out of it, or
the process is stopping) writes the finishes it holds and hands the jobs started ahead (in a
window or with their hold) back to pending with their attempt refunded (:meth:`Message.close`).

The decisions stay the core's (:mod:`harvest.execution.core`): each attempt says what it does
first; this module only chooses which of their writes share a statement.
"""

from __future__ import annotations

import collections
import logging
import time
from collections import Counter
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harvest.execution import delivery, grouping, sql
from harvest.execution import effects as fx
from harvest.execution.messages import Item
from harvest.jobs import Started

if TYPE_CHECKING:
    from harvest.app import JobSpec
    from harvest.execution.sync_shell import SyncShell

log = logging.getLogger("harvest.runner")

# What the next job may do ahead, while the job before it ends: no waiting, no write to
# Postgres (its rate permit and key lease: the key of the job before is already released).
AHEAD = (fx.Clock, fx.RatePermit, fx.LeaseKey, fx.LoadPool)
MAX_WINDOW = 64  # jobs started together at most
ENDED_EARLY = "the message ended before its turn"
Attempt = Generator[fx.Effect, Any, Any]
Taken = tuple[sql.Pair, "sql.Held | Started"]  # a job of a message: held, or held and started


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


class RunTimes:
    """Each job name's recent handler run time in this process, seconds: the third quartile of
    its last :data:`KEPT` runs. A few slow runs among fast ones (the machine busy for a moment)
    do not stop a name's jobs from sharing writes; a name whose jobs turn slow stops within a
    quarter of that many runs (and a window's ends never wait past their linger for it:
    :meth:`Message._may_wait` is asked again before each job's turn)."""

    KEPT = 16

    def __init__(self) -> None:
        self._runs: dict[str, collections.deque[float]] = {}
        self._of: dict[str, float] = {}

    def saw(self, name: str, seconds: float) -> None:
        runs = self._runs.get(name)
        if runs is None:
            runs = self._runs[name] = collections.deque(maxlen=self.KEPT)
        runs.append(seconds)
        ordered = sorted(runs)
        self._of[name] = ordered[(3 * len(ordered)) // 4]

    def of(self, name: str) -> float | None:
        return self._of.get(name)


def joins(spent: float | None, ran: float | None, linger: float) -> bool:
    """Whether a job of run time ``ran`` joins a window whose jobs before it run ``spent``
    seconds together: both known, and at most ``linger`` with it (None: not known)."""
    return spent is not None and ran is not None and spent + ran <= linger


def at_hold(
    items: Sequence[Item], jobs: Mapping[str, JobSpec], run_times: RunTimes, linger: float
) -> int:
    """How many of a message's first jobs are held and started in one write: the first, when
    it needs nothing of the gate (:func:`~harvest.execution.delivery.starts_at_hold`: it
    starts right after its hold anyway), and after it those that also need nothing of the
    gate, of names whose run times in this process are known and add up, with the first's,
    to at most ``linger`` (a window, as :class:`Message` begins one)."""
    spent: float | None = 0.0
    ids: set[int] = set()
    for n, item in enumerate(items[:MAX_WINDOW]):
        spec = jobs.get(item.name or "")
        if spec is None or spec.is_async or not delivery.starts_at_hold(spec):
            return n
        ran = run_times.of(spec.name)
        if item.job_id in ids or (n and not joins(spent, ran, linger)):
            return n
        spent = None if spent is None or ran is None else spent + ran
        ids.add(item.job_id)
    return min(len(items), MAX_WINDOW)


class Ahead:
    """A job of a message begun before its turn: driven up to its first effect that may not go
    ahead (``strict``: its first effect other than the clock: no permit or key taken early).
    Its turn goes on from there; ``result`` is that effect's, if it was performed with the
    job before's write."""

    def __init__(self, gen: Attempt, *, strict: bool = False) -> None:
        self.gen = gen
        self.strict = strict
        self.release: fx.ReleaseKey | None = None  # the job before's key, given back with
        # this one's lease (one round trip), or alone before that job's Finish
        self.at = Paused()
        self.result: tuple[Any, BaseException | None] | None = None  # of ``at.effect``, if done
        self.raised: BaseException | None = None

    def begin(self, shell: SyncShell) -> None:
        """Drive it up to its first effect that may not go ahead; what it raised is raised in
        its own turn."""
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                self.at = shell.advance(self.gen, value, error, stop=self._stops)
                lease = self.at.effect
                if not (isinstance(lease, fx.LeaseKey) and self.release is not None):
                    return
                done, self.release = self.release, None
                value, error = caught(shell.release_then_lease, done, lease)
        except Exception as exc:
            self.raised = exc

    def _stops(self, e: fx.Effect) -> bool:
        if self.strict:
            return not isinstance(e, fx.Clock)
        return not isinstance(e, AHEAD) or (isinstance(e, fx.LeaseKey) and self.release is not None)

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
        self.parked: list[Parked] = []
        self.counts: Counter[str] = Counter()
        self.linger, self.settle = shell.lingers

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
        if self.parked and not (self._started(i, begun) and self._may_wait(i)):
            self._write([], [])  # it may run long: the ends waiting for it go now
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
            return isinstance(e, fx.Finish) or (
                isinstance(e, fx.ReleaseKey) and not last and i + 1 not in self.begun
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

    def _started(self, j: int, begun: Ahead | None) -> bool:
        """Whether job ``j`` (``begun``: begun ahead as that) was started before its turn: with
        its hold, or in the statement that ended the job before it."""
        if self._at_hold(j):
            return True
        return begun is not None and begun.start is not None and begun.result is not None

    def _at_hold(self, j: int) -> bool:
        """Whether job ``j`` was held and started in one write (:func:`at_hold`)."""
        return j < len(self.jobs) and isinstance(self.jobs[j][1], Started)

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
        and, where job ``j`` asks for its Start, the short keyless jobs after it whose run times
        fit in the write linger. Returns those of them that ask for their Start, in order."""
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
        k = j + 1
        while spent is not None and k < len(self.attempts) and len(window) < MAX_WINDOW:
            ran = self._run_time(k)
            if ran is None or not (self._keyless(k) and joins(spent, ran, self.linger)):
                break
            ahead = Ahead(self.attempts[k], strict=True)
            ahead.begin(self.shell)
            self.begun[k] = ahead
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
        back = []
        for ahead in self.begun.values():
            start, result = ahead.start, ahead.result
            if start is not None and result is not None and isinstance(result[0], Started):
                back.append(sql.Defer(start.job_id, start.token, 0.0, ENDED_EARLY, started=True))
            self._abandon(ahead)
        self.begun.clear()
        for j in range(self.turn, len(self.jobs)):
            if self._at_hold(j):  # started with its hold; its turn never began
                (job_id, token), _ = self.jobs[j]
                back.append(sql.Defer(job_id, token, 0.0, ENDED_EARLY, started=True))
                self.attempts[j].close()
        if back:
            try:
                self.shell.writer.write("defer", back)
            except Exception as exc:
                log.warning("jobs started ahead not handed back (%s): rescue takes them back "
                            "when their leases expire", type(exc).__name__)  # fmt: skip

    def _abandon(self, ahead: Ahead) -> None:
        """:class:`Abandoned` is thrown into a job begun ahead, so it gives back what it took
        (its key lease)."""
        if ahead.raised is not None or ahead.at.done:
            return
        try:
            self.shell.advance(ahead.gen, None, Abandoned(ENDED_EARLY))
        except Abandoned:
            pass
        except Exception as exc:
            log.warning("a job begun ahead was not wound down (%s)", type(exc).__name__)
