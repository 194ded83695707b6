"""The fenced statements of execution, written once for both shells.

Each function returns a :class:`Query`: the SQL (psycopg's ``%(name)s`` style), its parameters
and how to read its rows. The blocking shell runs it with :func:`run` on a psycopg connection,
the asyncio shell with :func:`arun` on an async one; neither knows any SQL. Every statement
takes many jobs at once (``unnest`` of arrays), and every row is fenced by its own lease token:
a row whose token no longer matches is left out of the result alone, never the group. The same
statement with one row is the single-job form.
"""

from __future__ import annotations

import contextlib
import re
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from psycopg import AsyncConnection
from psycopg import Connection as PgConnection
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection

from harvest.jobs import Started
from harvest.models import JobStatus

T = TypeVar("T")
R = TypeVar("R", "Finish", "Defer")


@dataclass(frozen=True, slots=True)
class Query(Generic[T]):
    """One statement: what to send, and how to read what comes back."""

    sql: str
    params: Mapping[str, Any]
    parse: Callable[[list[Any]], T]


def psycopg_style(sql: str) -> str:
    """SQL written with SQLAlchemy's ``:name`` parameters in psycopg's own ``%(name)s`` style,
    for the statements run here on the driver connection."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql.replace("%", "%%"))


def raw(conn: Connection | PgConnection[Any]) -> PgConnection[Any]:
    """The psycopg connection under a SQLAlchemy one (autocommit there means autocommit here)."""
    if isinstance(conn, PgConnection):
        return conn
    if not conn.in_transaction():
        conn.begin()  # what conn.execute would do (autobegin), so the caller's commit counts
    driver = conn.connection.driver_connection
    assert isinstance(driver, PgConnection)
    return driver


def prepares(conn: PgConnection[Any] | AsyncConnection[Any]) -> bool:
    """Whether to prepare a statement server-side at its first run: the statements run through
    here run for each job (or each claim), and planning one was as much Postgres time as
    running it. Not on a
    connection that prepares nothing (``prepare_threshold`` None: behind a transaction-mode
    pooler, see :func:`harvest.db.connect_options`)."""
    return conn.prepare_threshold is not None


def run(conn: Connection | PgConnection[Any], query: Query[T]) -> T:
    """Run ``query`` on a blocking connection (psycopg's, or the driver's under SQLAlchemy's,
    in its transaction), prepared where the connection allows (:func:`prepares`)."""
    driver = raw(conn)
    with driver.cursor(row_factory=namedtuple_row) as cur:
        cur.execute(query.sql, query.params, prepare=prepares(driver))
        return query.parse(cur.fetchall() if cur.description else [])


def run_generic(conn: Connection | PgConnection[Any], query: Query[T]) -> T:
    """:func:`run` on an autocommit connection, with a generic plan for ``query`` however
    the session plans the rest: ``plan_cache_mode`` is set for the statement alone and reset
    after it, the three in one pipeline (one round trip); should the statement fail, the
    setting does not outlive it either (its transaction is rolled back, the SET with it).

    For a statement whose plan is the same for all its parameters, but whose custom plan
    Postgres would otherwise make again at every run, because a generic plan's estimates
    (ten percent of the rows for a ``LIMIT`` it cannot see) cost more than a custom one's."""
    driver = raw(conn)
    if not _sets_generic(driver):
        return run(driver, query)
    with driver.cursor(row_factory=namedtuple_row) as cur:
        with driver.pipeline():
            driver.execute(_GENERIC)
            cur.execute(query.sql, query.params, prepare=True)
            driver.execute(_DEFAULT_PLANS)
        return query.parse(cur.fetchall() if cur.description else [])


_GENERIC = "SET plan_cache_mode = force_generic_plan"
_DEFAULT_PLANS = "RESET plan_cache_mode"
# Connections inside a :func:`generic_plans` block (weakly held: a connection closed in one
# does not linger here).
_GENERIC_NOW: weakref.WeakSet[PgConnection[Any]] = weakref.WeakSet()


def _sets_generic(driver: PgConnection[Any]) -> bool:
    """Whether the plan setting is harvest's to make on ``driver`` now: it prepares, is in
    autocommit, and is not inside a :func:`generic_plans` block already."""
    return prepares(driver) and driver.autocommit and driver not in _GENERIC_NOW


@contextlib.contextmanager
def generic_plans(conn: Connection | PgConnection[Any]) -> Iterator[None]:
    """Within the block, every statement on ``conn`` (autocommit) plans generically, and
    :func:`run_generic` sends its statement alone: the setting is made once on entry and reset
    on exit, where :func:`run_generic` otherwise sets and resets it around each statement (two
    more statements for the server, and the pipeline's client work: measured 60-100 us a
    claim). For a caller that runs a statement of :func:`run_generic`'s many times in a row,
    and whose other statements in the block take a generic plan as well as a custom one.

    Nothing changes where :func:`run_generic` would not set the mode (a connection that
    prepares nothing, or in a transaction). Should the block fail, the setting is reset all
    the same; should the reset itself fail, the connection is broken and its pool drops it."""
    driver = raw(conn)
    if not _sets_generic(driver):
        yield
        return
    driver.execute(_GENERIC)
    _GENERIC_NOW.add(driver)
    try:
        yield
    finally:
        _GENERIC_NOW.discard(driver)
        driver.execute(_DEFAULT_PLANS)


async def arun(conn: AsyncConnection[Any], query: Query[T]) -> T:
    """Run ``query`` on an asyncio connection."""
    async with conn.cursor(row_factory=namedtuple_row) as cur:
        await cur.execute(query.sql, query.params, prepare=prepares(conn))
        return query.parse(await cur.fetchall() if cur.description else [])


Pair = tuple[int, uuid.UUID]


def _in(*states: str) -> str:
    """A row's state test that the planner cannot match to a partial index. Written plainly
    (``j.status = 'dispatched'``), it lets the planner walk the lease index (partial on the
    states in flight) when statistics taken between floods say few rows are in flight: each
    statement then read every row in flight to find its one (measured: 0.7 ms a statement
    with 6,000 in flight, against 0.15 ms by primary key). Inside a CASE it is a filter only,
    and each row is found by its id."""
    listed = ", ".join(f"'{state}'" for state in states)
    return f"CASE WHEN j.status IN ({listed}) THEN true END"


# Every grouped statement takes its rows in the order of their job ids: its plan walks the
# ``unnest`` arrays in order, each row found by its id, so two grouped statements cannot
# deadlock on rows they share (a group of finishes and the heartbeat of every lease in flight
# could, each taking the rows in the order its jobs came). finish_then_start's two halves run
# in an order Postgres chooses: a deadlock there is rare, and retried (patience.rolled_back).


def _pairs(jobs: Sequence[Pair]) -> dict[str, Any]:
    jobs = sorted(jobs, key=lambda job: job[0])
    return {"ids": [j[0] for j in jobs], "tokens": [j[1] for j in jobs]}


def _by_id(rows: Sequence[R]) -> list[R]:
    return sorted(rows, key=lambda row: row.job_id)


_HOLD = f"""
    UPDATE harvest_jobs AS j
    SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS m(id, token)
    WHERE j.id = m.id AND j.lease_token = m.token
      AND {_in("dispatched")}
    RETURNING j.id, j.name, j.attempts, j.max_attempts, j.payload,
              extract(epoch FROM now() - j.deferred_since) AS deferred_for
"""


@dataclass(frozen=True, slots=True)
class Held:
    """A job of a message this worker holds: its name, and its attempts so far."""

    name: str
    attempts: int
    deferred_for: float | None = None  # seconds since a run of deferrals began (None: none)
    payload: dict[str, Any] | None = None  # what a job's token cost is worked out from
    max_attempts: int = 0  # its attempts allowed (0: not known)


def _held(rows: list[Any]) -> dict[int, Held]:
    return {
        int(r.id): Held(
            str(r.name),
            int(r.attempts),
            float(r.deferred_for) if r.deferred_for is not None else None,
            r.payload,
            int(r.max_attempts),
        )
        for r in rows
    }


def hold(jobs: Sequence[Pair], *, ttl: float) -> Query[dict[int, Held]]:
    """A worker took a message: extend the dispatch leases of its jobs whose token still
    matches. A duplicate or stale delivery (job already started, finished, or dispatched again
    with a new token) matches nothing and is left out of the result."""
    return Query(
        _HOLD,
        {**_pairs(jobs), "ttl": ttl},
        _held,
    )


_START = f"""
    UPDATE harvest_jobs AS j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'running' END,
        attempts = j.attempts + CASE WHEN j.cancel_requested THEN 0 ELSE 1 END,
        started_at = now(), worker = %(worker)s, deferred_since = NULL,
        finished_at = CASE WHEN j.cancel_requested THEN now() END,
        lease_token = CASE WHEN j.cancel_requested THEN NULL ELSE j.lease_token END,
        lease_expires_at = CASE WHEN j.cancel_requested THEN NULL
                                ELSE now() + make_interval(secs => %(ttl)s) END
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS m(id, token)
    WHERE j.id = m.id AND j.lease_token = m.token
      AND {_in("dispatched")}
    RETURNING j.id, m.token, j.name, j.payload, j.attempts, j.max_attempts, j.timeout, j.status,
              j.tenant
"""

StartResult = Started | JobStatus


def _started(rows: list[Any]) -> dict[int, StartResult]:
    out: dict[int, StartResult] = {}
    for r in rows:
        if r.status != "running":
            out[int(r.id)] = JobStatus(r.status)
            continue
        out[int(r.id)] = Started(
            id=int(r.id),
            token=r.token,
            name=r.name,
            payload=r.payload,
            attempt=r.attempts,
            max_attempts=r.max_attempts,
            timeout=r.timeout,
            cancel_requested=False,
            tenant=r.tenant,
        )
    return out


def start(jobs: Sequence[Pair], *, ttl: float, worker: str | None) -> Query[dict[int, StartResult]]:
    """Dispatched -> running, attempt counted, just before each handler runs. A job whose
    cancellation was requested meanwhile ends cancelled here instead (its value is
    ``JobStatus.CANCELLED``). A job missing from the result lost its lease (a duplicate or
    stale delivery)."""
    return Query(_START, {**_pairs(jobs), "ttl": ttl, "worker": worker}, _started)


_HEARTBEAT = f"""
    UPDATE harvest_jobs AS j
    SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS m(id, token)
    WHERE j.id = m.id AND j.lease_token = m.token
      AND {_in("dispatched", "running")}
    RETURNING j.id, j.cancel_requested
"""


def heartbeat(jobs: Sequence[Pair], *, ttl: float) -> Query[dict[int, bool]]:
    """Extend the leases still held (jobs running, or held waiting their turn). The result
    maps each job still held to whether its cancellation was requested."""
    return Query(
        _HEARTBEAT,
        {**_pairs(jobs), "ttl": ttl},
        lambda rows: {int(r.id): bool(r.cancel_requested) for r in rows},
    )


# A retry ('pending') of a job someone asked to cancel ends it cancelled instead: harvest
# checks the cancel request before any retry, whether or not the handler saw it.
_FINISH = f"""
    UPDATE harvest_jobs AS j
    SET status = CASE WHEN f.status = 'pending' AND j.cancel_requested THEN 'cancelled'
                      ELSE f.status END,
        result = f.result::jsonb, last_error = f.error, last_traceback = f.traceback,
        lease_token = NULL, lease_expires_at = NULL,
        finished_at = CASE WHEN f.status = 'pending' AND NOT j.cancel_requested THEN NULL
                           ELSE now() END,
        run_at = CASE WHEN f.status = 'pending' AND NOT j.cancel_requested
                      THEN now() + make_interval(secs => f.delay) ELSE j.run_at END,
        attempts = j.attempts - f.refund
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(statuses)s::text[],
                %(results)s::text[], %(errors)s::text[], %(tracebacks)s::text[],
                %(delays)s::float8[], %(refunds)s::int[])
         AS f(id, token, status, result, error, traceback, delay, refund)
    WHERE j.id = f.id AND j.lease_token = f.token
      AND {_in("running")}
    RETURNING j.id
"""


@dataclass(frozen=True, slots=True)
class Finish:
    """One attempt's fenced ending."""

    job_id: int
    token: uuid.UUID
    status: JobStatus
    result_json: str | None = None
    error: str | None = None
    traceback: str | None = None
    retry_delay: float = 0.0
    refund_attempt: bool = False


def finish(rows: Sequence[Finish]) -> Query[set[int]]:
    """The one fenced write that ends each attempt; the result holds the ids written. A job
    missing from it lost its lease: nothing was written for it (a newer attempt owns it).
    ``refund_attempt``: the attempt did not count (its key was rate limited or rejected, or the
    worker handed it back at shutdown), so a retry does not use up an attempt."""
    rows = _by_id(rows)
    params = {
        "ids": [r.job_id for r in rows],
        "tokens": [r.token for r in rows],
        "statuses": [str(r.status) for r in rows],
        "results": [r.result_json for r in rows],
        "errors": [r.error for r in rows],
        "tracebacks": [r.traceback for r in rows],
        "delays": [float(r.retry_delay) for r in rows],
        "refunds": [int(r.refund_attempt and r.status is JobStatus.PENDING) for r in rows],
    }
    return Query(_FINISH, params, lambda found: {int(r.id) for r in found})


def _prefixed(statement: str, prefix: str) -> str:
    """``statement`` with each of its parameters renamed ``prefix`` + name."""
    return statement.replace("%(", f"%({prefix}")


# Two UPDATEs of different rows in one statement: both happen or neither, in one commit.
_FINISH_THEN_START = f"""
    WITH finished AS ({_FINISH}), started AS ({_prefixed(_START, "next_")})
    SELECT f.ids, s.*
    FROM (SELECT array_agg(id) AS ids FROM finished) AS f LEFT JOIN started AS s ON true
"""


def finish_then_start(
    rows: Sequence[Finish], jobs: Sequence[Pair], *, ttl: float, worker: str | None
) -> Query[tuple[set[int], dict[int, StartResult]]]:
    """Jobs of a message ending and the next ones starting, in one statement: one round trip
    and one commit where :func:`finish` then :func:`start` take two (the blocking shell runs a
    message's jobs one after another: :mod:`harvest.execution.run_ahead`). Each half is fenced
    exactly as alone; the result is both of theirs. No job may be in both halves, nor twice in
    one."""
    ended, begun = finish(rows), start(jobs, ttl=ttl, worker=worker)
    params = {**ended.params, **{f"next_{k}": v for k, v in begun.params.items()}}

    def parse(found: list[Any]) -> tuple[set[int], dict[int, StartResult]]:
        ids = found[0].ids if found else None
        return {int(i) for i in ids or ()}, _started([r for r in found if r.id is not None])

    return Query(_FINISH_THEN_START, params, parse)


# A job that started and then found no key steps back: its attempt is refunded.
_DEFER = f"""
    UPDATE harvest_jobs AS j
    SET status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'pending' END,
        finished_at = CASE WHEN j.cancel_requested THEN now() END,
        lease_token = NULL, lease_expires_at = NULL,
        attempts = j.attempts - CASE WHEN d.started THEN 1 ELSE 0 END,
        deferred_since = COALESCE(j.deferred_since, now()),
        last_error = COALESCE(d.reason, j.last_error),
        run_at = now() + make_interval(secs => d.delay)
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(delays)s::float8[], %(reasons)s::text[],
                %(started)s::boolean[])
         AS d(id, token, delay, reason, started)
    WHERE j.id = d.id AND j.lease_token = d.token
      AND {_in("dispatched", "running")} AND (j.status = 'running') = d.started
    RETURNING j.id
"""


@dataclass(frozen=True, slots=True)
class Defer:
    """A held job that goes back to pending without running its handler."""

    job_id: int
    token: uuid.UUID
    delay: float
    reason: str | None = None  # kept as its last error (None: the last error is kept)
    started: bool = False  # it started (to wait for its key): the attempt is refunded


def defer(rows: Sequence[Defer]) -> Query[set[int]]:
    """Held jobs that could not run (no key or permit within a short wait, an unknown job
    name, a worker shutting down) go back to pending after their delay, without counting an
    attempt and without holding a worker (or end cancelled, when cancellation was requested);
    one that had started to wait for its key gets its attempt back. ``deferred_since``
    remembers when the first of a run of deferrals happened."""
    rows = _by_id(rows)
    params = {
        "ids": [r.job_id for r in rows],
        "tokens": [r.token for r in rows],
        "delays": [float(r.delay) for r in rows],
        "reasons": [r.reason for r in rows],
        "started": [r.started for r in rows],
    }
    return Query(_DEFER, params, lambda found: {int(r.id) for r in found})


_BUMP = """
    INSERT INTO harvest_counters (name, value)
    SELECT * FROM unnest(%(names)s::text[], %(values)s::bigint[])
    ON CONFLICT (name) DO UPDATE SET value = harvest_counters.value + EXCLUDED.value
"""


def bump(counts: Mapping[str, int]) -> Query[None]:
    """Add to several counters of ``harvest_counters`` at once."""
    names = sorted(name for name, n in counts.items() if n)  # sorted: no lock-order deadlock
    return Query(_BUMP, {"names": names, "values": [counts[n] for n in names]}, lambda rows: None)
