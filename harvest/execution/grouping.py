"""What a grouped writer decides, for both of its shells: the asyncio one
(:mod:`~harvest.execution.writer`, the jobs of an event loop) and the threaded one
(:mod:`~harvest.execution.thread_writer`, the sync jobs of ``-P threads`` and ``-P gevent``).

Writes are gathered by kind (holds, starts, finishes, deferrals) and each kind is written as one
statement, every row fenced by its own lease token: a row whose token no longer matches is
refused alone, never the group. A row waits at most its kind's linger after it arrives, or until
the statement of its kind in flight is done, whichever is later: each kind has at most one
statement in flight (group commit), so the busier the process, the larger each statement, and no
write waits on a timer while the database is idle. A statement that fails for a row's data is
split so that only that row fails (:class:`Writing`). A statement never carries two rows of one
job: a job can come twice (a message delivered again, or the old message of a job that was
rescued and dispatched anew), and Postgres updates a row once for a statement however many of its
rows match it, so both would read as written. The later row waits for the next statement, where
it meets the row as the first one left it, as if each had been written alone.

Nothing here does I/O or knows what a future is made of: a shell keeps the time, waits, runs the
statements a :class:`Writing` names and completes the futures it is given (asyncio's or
``concurrent.futures``', both have ``done``, ``set_result`` and ``set_exception``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

import psycopg

from harvest.execution import sql

MAX_ROWS = 500  # rows of one statement
SETTLE_SHARE = 0.02  # of a handler's run time its finish may wait to share a statement


class Settable(Protocol):
    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


Row = tuple[Any, Settable]  # what is written, and who waits for it


class Kind:
    """How one kind of write is grouped into a statement and read back per row, and what of it
    waits now."""

    def __init__(
        self,
        build: Callable[[Sequence[Any]], sql.Query[Any]],
        pick: Callable[[Any, Any], Any],
        job: Callable[[Any], int],
        linger: float,
    ) -> None:
        self.build, self.pick, self.job, self.linger = build, pick, job, linger
        self.waiting: list[Row] = []
        self.due = 0.0  # when what waits must go (the earliest of its rows' lingers)
        self.busy = False  # a statement of this kind is in flight

    def add(self, row: Row, now: float, linger: float | None = None) -> bool:
        """``row`` waits its linger (the kind's, or ``linger``); True when the kind is full and
        must go now."""
        due = now + (self.linger if linger is None else linger)
        self.due = min(self.due, due) if self.waiting else due
        self.waiting.append(row)
        return self.full()

    def full(self) -> bool:
        return len(self.waiting) >= MAX_ROWS

    def take(self, now: float) -> list[Row] | None:
        """The next statement's rows, the kind now busy with them (None: it is busy already,
        or nothing waits): at most :data:`MAX_ROWS`, one a job, in the order they came. What is
        left goes next, without a linger."""
        if self.busy or not self.waiting:
            return None
        batch: list[Row] = []
        left: list[Row] = []
        jobs: set[int] = set()
        for row in self.waiting:
            job = self.job(row[0])
            if job in jobs or len(batch) >= MAX_ROWS:
                left.append(row)
            else:
                jobs.add(job)
                batch.append(row)
        self.waiting = left
        self.due = now
        self.busy = True
        return batch


def kinds(*, ttl: float, worker: str, linger: float, settle: float) -> dict[str, Kind]:
    """The four kinds of grouped write. Holds and starts linger ``linger``: a job that holds
    its key writes its start before its call, so a start's wait is a key's idle time. Finishes
    (see :func:`finish_linger`) and deferrals may wait up to ``settle``: no key waits on them."""
    return {
        "hold": Kind(
            lambda pairs: sql.hold(pairs, ttl=ttl),
            lambda found, pair: found.get(pair[0]),
            _pair_job,
            linger,
        ),
        "start": Kind(
            lambda pairs: sql.start(pairs, ttl=ttl, worker=worker),
            lambda found, pair: found.get(pair[0]),
            _pair_job,
            linger,
        ),
        "finish": Kind(sql.finish, lambda found, row: row.job_id in found, _row_job, settle),
        "defer": Kind(sql.defer, lambda found, row: row.job_id in found, _row_job, settle),
    }


def _pair_job(pair: sql.Pair) -> int:
    return pair[0]


def _row_job(row: sql.Finish | sql.Defer) -> int:
    return row.job_id


def finish_linger(linger: float, settle: float, ran: float) -> float:
    """How long a finish waits for company: :data:`SETTLE_SHARE` of the seconds its handler
    ran, at least ``linger`` and at most ``settle``. A call of seconds can wait milliseconds to
    share a statement; a short job cannot."""
    return min(settle, max(linger, ran * SETTLE_SHARE))


class Counts:
    """Statements and rows written so far (for tests and the log)."""

    def __init__(self) -> None:
        self.statements = 0
        self.rows = 0


class Writing:
    """One batch being written: :attr:`query` is the next statement to run (None: every row
    has its answer). The shell runs it and reports :meth:`answered` or :meth:`failed`."""

    def __init__(self, kind: Kind, batch: list[Row], counts: Counts) -> None:
        self._steps = written(kind, batch, counts)
        self.query: sql.Query[Any] | None = self._advance(None, None)

    def answered(self, value: Any) -> None:
        self.query = self._advance(value, None)

    def failed(self, error: psycopg.Error) -> None:
        self.query = self._advance(None, error)

    def _advance(self, value: Any, error: BaseException | None) -> sql.Query[Any] | None:
        try:
            return self._steps.throw(error) if error is not None else self._steps.send(value)
        except StopIteration:
            return None


def written(kind: Kind, batch: list[Row], counts: Counts) -> Generator[sql.Query[Any], Any, None]:
    """Write ``batch`` as one statement (yielded; the shell runs it and sends back what it
    returned, or throws what it raised) and give each row its own answer. A statement that
    fails for a row's data is written again one row at a time, so only that row fails; one that
    failed for the connection fails every row of it."""
    try:
        found = yield kind.build([item for item, _ in batch])
    except psycopg.Error as exc:
        if len(batch) > 1 and not isinstance(exc, psycopg.OperationalError):
            for one in batch:  # a row's data broke the statement: find it, alone
                yield from written(kind, [one], counts)
            return
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)
        return
    counts.statements += 1
    counts.rows += len(batch)
    for item, future in batch:
        if not future.done():
            future.set_result(kind.pick(found, item))
