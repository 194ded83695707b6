"""How long one statement is tried again while Postgres does not answer, or after it rolled
the statement back to break a deadlock: one policy for the blocking shell
(:meth:`~harvest.execution.sync_shell.SyncShell.db`) and the grouped writer of the asyncio
shell (:meth:`~harvest.execution.writer.Writer.run`); only the waiting differs.

A job's write that gives up too soon costs more than its wait: a finish that is not written
leaves the job held until its lease expires, and rescue then runs again a call that was made.
Tries go on for half the lease's time to live (the job's lease is not renewed while Postgres
is away, and past its expiry rescue may take the job back, so the write could no longer land),
the first again at once (a backend terminated under one connection: the pool's next one
answers), then after pauses doubling from 50 ms to 1 s. Every statement is fenced by its lease
token, so a try of one that did land changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

log = logging.getLogger("harvest.runner")

FIRST, LONGEST = 0.05, 1.0
ROLLED_BACK = {"40001", "40P01"}  # serialization_failure, deadlock_detected


def pauses(patience: float, clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
    """The pauses before each try again, while the try would start within ``patience``
    seconds of the first: 0, then 50 ms doubling to at most 1 s."""
    deadline = clock() + patience
    pause = 0.0
    while clock() + pause <= deadline:
        yield pause
        pause = min(max(pause * 2, FIRST), LONGEST)


def unanswered(exc: BaseException, conn: Any) -> bool:
    """Whether ``exc``, raised by psycopg while a statement was tried on ``conn`` (None: while
    a connection was being had), says Postgres did not answer, so the statement is worth
    trying again: none could be had, or the one it ran on broke. On a connection that still
    works an OperationalError is the statement's own failure (a statement timeout, a
    cancelled query), and a second try would only fail again."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    return conn is None or bool(conn.broken)


def rolled_back(exc: BaseException) -> bool:
    """Whether Postgres rolled the statement back to break a cycle of waits (a deadlock, or a
    serialization failure): nothing of it happened, and the same statement tried again goes
    through once the other transaction has. A process's writes meet each other this way: its
    heartbeat extends the leases of all its jobs in one statement while a job's finish and the
    next job's start lock two of those rows in another order (seen in CI: the finish was given
    up, the job's lease expired and rescue ran its handler a second time)."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate in ROLLED_BACK


def worth_retrying(exc: BaseException, conn: Any) -> bool:
    """:func:`unanswered` or :func:`rolled_back`: the one rule both shells' writes follow."""
    return unanswered(exc, conn) or rolled_back(exc)


def retrying(exc: BaseException, pause: float) -> None:
    """Log a try again (the type only: a driver's message may carry the URL)."""
    log.warning("write failed (%s); retrying in %.2fs", type(exc).__name__, pause)
