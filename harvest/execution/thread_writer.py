"""Grouped fenced writes for the sync jobs in flight in one ``-P threads`` or ``-P gevent``
process: the threaded shell of :mod:`~harvest.execution.grouping` (read it first; the asyncio
shell is :mod:`~harvest.execution.writer`).

There is no writer thread. The thread that finds a kind with nobody gathering it becomes its
leader: it waits out the kind's linger, writes what gathered meanwhile (its own rows and other
threads') as one statement, on a connection of the process's pool, and gives each row its
answer; if more rows gathered while it wrote, it hands the lead to the thread of the oldest of
them, and goes back to its job. The others wait for their own rows' answers. This is group
commit as Postgres does it for its WAL: one statement of a kind in flight, the rest gathering
behind it, so the more threads are busy, the fewer statements and commits per job.

A statement that fails for a transient reason is retried as the shell's every statement is
(``run``, :meth:`SyncShell.db`). A crash loses at most the writes gathered and not yet
committed: their jobs keep their leases, which expire, and rescue takes them back exactly as it
does a single job's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import psycopg

from harvest.execution import grouping, sql
from harvest.execution.grouping import Kind


class _Caller:
    """A thread waiting for the answers to its rows, or told to lead its kind."""

    __slots__ = ("futures", "leads", "woken")

    def __init__(self) -> None:
        self.futures: list[_Answer] = []
        self.leads = False
        self.woken = threading.Event()

    def answered(self) -> bool:
        return all(f.done() for f in self.futures)


class _Answer(Future[Any]):
    """One row's answer, and whose row it is."""

    def __init__(self, caller: _Caller) -> None:
        super().__init__()
        self.caller = caller


class Writes:
    """The fenced writes of a process's sync jobs (holds, starts, finishes, deferrals) and
    each row's answer. Here each is a statement of its own: a process that runs one sync job at
    a time (prefork, solo) has nothing to group them with. :class:`ThreadWriter` groups them."""

    grouped = False

    def __init__(
        self,
        run: Callable[[sql.Query[Any]], Any],
        *,
        ttl: float,
        worker: str,
        linger: float = 0.0,
        settle: float = 0.0,
    ) -> None:
        self._run = run
        self._linger, self._settle = linger, settle
        self._kinds = grouping.kinds(ttl=ttl, worker=worker, linger=linger, settle=settle)

    def hold(self, pairs: Sequence[sql.Pair]) -> dict[int, sql.Held]:
        """A message's jobs taken (duplicates and stale deliveries left out)."""
        found = self.write("hold", pairs)
        return {pair[0]: held for pair, held in zip(pairs, found, strict=True) if held is not None}

    def start(self, pair: sql.Pair) -> sql.StartResult | None:
        return self.write("start", [pair])[0]  # type: ignore[no-any-return]

    def finish(self, row: sql.Finish, ran: float = 0.0) -> bool:
        linger = grouping.finish_linger(self._linger, self._settle, ran)
        return bool(self.write("finish", [row], linger)[0])

    def defer(self, row: sql.Defer) -> bool:
        return bool(self.write("defer", [row])[0])

    def write(self, name: str, items: Sequence[Any], linger: float | None = None) -> list[Any]:
        """Each item's answer to a write of kind ``name`` (:func:`grouping.kinds`)."""
        kind = self._kinds[name]
        found = self._run(kind.build(items))
        return [kind.pick(found, item) for item in items]


class ThreadWriter(Writes):
    grouped = True

    def __init__(
        self,
        run: Callable[[sql.Query[Any]], Any],
        *,
        ttl: float,
        worker: str,
        linger: float,
        settle: float,
    ) -> None:
        super().__init__(run, ttl=ttl, worker=worker, linger=linger, settle=settle)
        self._lock = threading.Lock()
        self._leaders: dict[str, _Caller] = {}  # a kind -> the thread gathering or writing it
        self.written = grouping.Counts()

    def write(self, name: str, items: Sequence[Any], linger: float | None = None) -> list[Any]:
        """Each item's answer, written in the next statement of its kind with what the other
        threads gathered (this thread leading it, or waiting for the thread that does)."""
        kind = self._kinds[name]
        me = _Caller()
        with self._lock:
            now = time.monotonic()
            for item in items:
                answer = _Answer(me)
                me.futures.append(answer)
                kind.add((item, answer), now, linger)
            if name not in self._leaders:
                self._leaders[name] = me
                me.leads = True
        try:
            while not me.answered():
                if me.leads:
                    me.leads = False
                    self._lead(name, kind, me)
                else:
                    me.woken.wait()
                    me.woken.clear()
        except BaseException:  # interrupted (gevent.Timeout, KeyboardInterrupt): never leave
            with self._lock:  # the others waiting for a leader that is gone
                kind.waiting = [row for row in kind.waiting if _caller(row) is not me]
                nxt = self._pass(name, kind, me) if self._leaders.get(name) is me else None
            if nxt is not None:
                nxt.woken.set()
            raise
        return [f.result() for f in me.futures]

    def _lead(self, name: str, kind: Kind, me: _Caller) -> None:
        """Gather ``kind`` for its linger, write it, then pass the lead on (or keep it, while
        rows of this thread's own wait)."""
        while True:
            batch: list[grouping.Row] = []
            try:
                with self._lock:
                    wait = 0.0 if kind.full() else kind.due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with self._lock:
                    batch = kind.take(time.monotonic()) or []
                if batch:
                    self._write(kind, batch)
            finally:
                with self._lock:
                    kind.busy = False
                    nxt = self._pass(name, kind, me)
                for caller in {_caller(row) for row in batch}:
                    if caller is not me and caller.answered():
                        caller.woken.set()
                if nxt is not None and nxt is not me:
                    nxt.woken.set()
            if nxt is not me:
                return

    def _pass(self, name: str, kind: Kind, me: _Caller) -> _Caller | None:
        """(Under the lock.) The lead of ``kind`` to the thread of its oldest waiting row, told
        so unless it is ``me``; None when no row waits (the kind is free)."""
        if not kind.waiting:
            del self._leaders[name]
            return None
        nxt = self._leaders[name] = _caller(kind.waiting[0])
        nxt.leads = nxt is not me
        return nxt

    def _write(self, kind: Kind, batch: list[grouping.Row]) -> None:
        writing = grouping.Writing(kind, batch, self.written)
        try:
            while writing.query is not None:
                try:
                    writing.answered(self._run(writing.query))
                except psycopg.Error as exc:
                    writing.failed(exc)
        except BaseException as exc:  # not Postgres's answer: every row still waiting gets one
            failed = exc if isinstance(exc, Exception) else Interrupted(exc)
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(failed)
            if failed is not exc:
                raise


class Interrupted(RuntimeError):
    """The thread writing a statement was interrupted (``error``) before it was answered: the
    rows of other threads in it may or may not have been written."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"the statement's writer was interrupted ({type(error).__name__})")


def _caller(row: grouping.Row) -> _Caller:
    answer = row[1]
    assert isinstance(answer, _Answer)
    return answer.caller
