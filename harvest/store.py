"""Every statement on harvest's job tables.

Each check-and-act is one statement, judged by the database clock (``now()``). Writes that
belong to a running attempt are fenced: ``WHERE id = :id AND lease_token = :token``; a write
that matches no row means the attempt lost its lease, and its outcome is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, RowMapping, TextClause, text
from sqlalchemy.orm import Session

from harvest.db import get_or_create
from harvest.jobs import Claimed, Job, Started
from harvest.models import JobRow, JobStatus, ScheduleRow

# --- enqueue --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewJob:
    """A validated job, ready to insert."""

    name: str
    queue: str
    payload_json: str
    priority: int
    run_at: datetime | None  # None: due now (database clock)
    delay: float | None  # seconds from the database's now(); used when run_at is None
    max_attempts: int
    timeout: float | None
    idempotency_key: str | None
    pool: str | None = None


_INSERT_ONE = text(
    """
    INSERT INTO harvest_jobs (name, queue, payload, priority, run_at, max_attempts, timeout, pool)
    VALUES (:name, :queue, CAST(:payload AS jsonb), :priority,
            COALESCE(CAST(:run_at AS timestamptz),
                     now() + make_interval(secs => COALESCE(CAST(:delay AS float8), 0))),
            :max_attempts, :timeout, :pool)
    RETURNING id
    """
)


def _params(job: NewJob) -> dict[str, Any]:
    return {
        "name": job.name,
        "queue": job.queue,
        "payload": job.payload_json,
        "priority": job.priority,
        "run_at": job.run_at,
        "delay": job.delay,
        "max_attempts": job.max_attempts,
        "timeout": job.timeout,
        "pool": job.pool,
    }


def insert_job(session: Session, job: NewJob) -> tuple[int, bool]:
    """Insert one job; with an idempotency key, get-or-create on it. Returns (id, created)."""
    if job.idempotency_key is None:
        return int(session.execute(_INSERT_ONE, _params(job)).scalar_one()), True
    defaults = {
        "name": job.name,
        "queue": job.queue,
        "payload": json.loads(job.payload_json),
        "priority": job.priority,
        "max_attempts": job.max_attempts,
        "timeout": job.timeout,
        "pool": job.pool,
    }
    if job.run_at is not None:
        defaults["run_at"] = job.run_at
    elif job.delay:
        defaults["run_at"] = text(f"now() + make_interval(secs => {float(job.delay)!r})")
    row, created = get_or_create(
        session, JobRow, lookup={"idempotency_key": job.idempotency_key}, defaults=defaults
    )
    return row.id, created


_RESERVE_IDS = text(
    """
    SELECT array_agg(nextval(pg_get_serial_sequence('harvest_jobs', 'id'))) AS ids, now() AS now
    FROM generate_series(1, :n)
    """
)
_COPY_MANY = (
    "COPY harvest_jobs (id, name, queue, payload, priority, run_at, max_attempts, timeout, pool)"
    " FROM STDIN"
)


BACKSLASH = "\\"
COPY_ROWS_PER_WRITE = 500  # bounds one write's memory (payloads may be up to 256 KiB each)


def _copy_text(value: Any) -> str:
    """One value in COPY's text format."""
    if value is None:
        return "\\N"
    text_value = value.isoformat() if isinstance(value, datetime) else str(value)
    return (
        text_value.replace("\\", "\\\\")
        .replace("\t", "\\t")
        .replace("\n", "\\n")
        .replace("\r", "\\r")
    )


def insert_many(conn: Connection, template: NewJob, payloads_json: Sequence[str]) -> list[int]:
    """Insert many jobs of one name with COPY (the fastest way rows get into Postgres).

    COPY returns nothing, so the ids are taken from the table's sequence first, in one round
    trip that also reads the database's clock: a delay counts from Postgres' ``now()`` (the
    transaction's start, as an INSERT's default would), never from this machine's clock.
    Must run inside the caller's transaction (it commits or rolls back with it)."""
    if not payloads_json:
        return []
    reserved = conn.execute(_RESERVE_IDS, {"n": len(payloads_json)}).one()
    ids = sorted(int(i) for i in reserved.ids)
    run_at = template.run_at or reserved.now + timedelta(seconds=template.delay or 0.0)
    t = template
    # The columns every row shares, formatted once; each row adds its id and payload. COPY's
    # text format: tab-separated, \N for NULL, backslashes doubled (the JSON text has no raw
    # tab or newline: json escapes them inside strings).
    head = "\t".join(_copy_text(v) for v in (t.name, t.queue))
    tail = "\t".join(_copy_text(v) for v in (t.priority, run_at, t.max_attempts, t.timeout, t.pool))
    raw = conn.connection.driver_connection
    assert raw is not None
    rows = list(zip(ids, payloads_json, strict=True))
    with raw.cursor() as cur, cur.copy(_COPY_MANY) as copy:
        for start in range(0, len(rows), COPY_ROWS_PER_WRITE):
            copy.write(
                "".join(
                    f"{job_id}\t{head}\t{payload.replace(BACKSLASH, BACKSLASH * 2)}\t{tail}\n"
                    for job_id, payload in rows[start : start + COPY_ROWS_PER_WRITE]
                )
            )
    return ids


# --- dispatch -------------------------------------------------------------------------------

_INFLIGHT = text("SELECT count(*) FROM harvest_jobs WHERE status IN ('dispatched', 'running')")


def inflight(conn: Connection) -> int:
    return int(conn.execute(_INFLIGHT).scalar_one())


_WAITING_FOR_KEYS = text(
    """
    SELECT pool, count(*) AS n FROM harvest_jobs
    WHERE status = 'dispatched' AND pool = ANY(:pools)
    GROUP BY pool
    """
)


def dispatched_by_pool(conn: Connection, pools: Sequence[str]) -> dict[str, int]:
    """Jobs of each pool dispatched but not started yet: they will each need a key."""
    rows = conn.execute(_WAITING_FOR_KEYS, {"pools": list(pools)})
    return {r.pool: int(r.n) for r in rows}


def _claim_statement(*, budgeted: bool) -> TextClause:
    """The claim, in one statement (one round trip, atomic on its own): due pending rows,
    locked with SKIP LOCKED, marked dispatched with a fresh lease token.

    Two scans feed it. ``aged``: up to ``:share`` rows due for longer than ``:starve`` seconds,
    oldest first (the aging share; index ``harvest_jobs_age_idx``; with ``:share`` 0 it reads
    nothing). ``fresh``: the rest, highest priority first (``harvest_jobs_claim_idx``). Each
    scan's LIMIT is a plain parameter, so the planner walks the index and stops (a LIMIT it
    cannot know at plan time made it sort the whole backlog); ``fresh`` may lock up to
    ``:share`` rows more than it takes, until the statement commits.
    ``budgeted``: at most ``budget`` rows of each named key pool, looking ``:scan`` rows deep."""
    update = """
    UPDATE harvest_jobs AS j
    SET status = 'dispatched', lease_token = gen_random_uuid(), dispatched_at = now(),
        lease_expires_at = now() + make_interval(secs => :ttl)
    FROM chosen WHERE j.id = chosen.id
    RETURNING j.id, j.lease_token, j.queue, j.name, j.priority, j.run_at, j.pool, chosen.aged
    """
    aged = """
    aged AS (
        SELECT id, pool, priority, run_at, true AS aged FROM harvest_jobs
        WHERE status = 'pending' AND run_at <= now() - make_interval(secs => :starve)
        ORDER BY run_at, id
        LIMIT :share
        FOR UPDATE SKIP LOCKED
    )"""

    def fresh(limit: str) -> str:
        return f"""
    fresh AS (
        SELECT id, pool, priority, run_at, false AS aged FROM harvest_jobs
        WHERE status = 'pending' AND run_at <= now()
          AND id <> ALL(ARRAY(SELECT id FROM aged))
        ORDER BY priority DESC, run_at, id
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED
    )"""

    if not budgeted:
        return text(
            f"""
            WITH {aged}, {fresh(":limit")},
            chosen AS (
                SELECT id, aged FROM aged
                UNION ALL
                (SELECT id, aged FROM fresh ORDER BY priority DESC, run_at, id
                 LIMIT :limit - (SELECT count(*) FROM aged))
            ) {update}"""
        )
    order = "aged DESC, priority DESC, run_at, id"
    return text(
        f"""
        WITH {aged}, {fresh(":scan")},
        cand AS (SELECT * FROM aged UNION ALL SELECT * FROM fresh),
        ranked AS (
            SELECT c.id, c.aged, c.priority, c.run_at, b.budget,
                   row_number() OVER (PARTITION BY c.pool ORDER BY {order}) AS rn
            FROM cand AS c
            LEFT JOIN unnest(CAST(:pools AS text[]), CAST(:budgets AS int[])) AS b(pool, budget)
                   ON b.pool = c.pool
        ), chosen AS (
            SELECT id, aged FROM ranked WHERE budget IS NULL OR rn <= budget
            ORDER BY {order}
            LIMIT :limit
        ) {update}"""
    )


_CLAIMS = {budgeted: _claim_statement(budgeted=budgeted) for budgeted in (False, True)}


def _psycopg_sql(clause: TextClause) -> str:
    """A text() statement in psycopg's own parameter style (``:name`` -> ``%(name)s``)."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", clause.text.replace("%", "%%"))


_CLAIMS_SQL = {budgeted: _psycopg_sql(clause) for budgeted, clause in _CLAIMS.items()}


def _fetch_raw(conn: Connection, sql: str, params: Mapping[str, Any]) -> list[Any]:
    """Run a hot statement (psycopg's parameter style) on the driver connection under
    ``conn`` (the same connection and transaction), prepared server-side: the claim runs
    hundreds of times a second, and SQLAlchemy's per-statement work was a third of its cost
    at small batches."""
    if not conn.in_transaction():
        conn.begin()  # what conn.execute would do (autobegin), so the caller's commit counts
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor(row_factory=namedtuple_row) as cur:
        cur.execute(sql, params, prepare=True)
        return list(cur.fetchall())


def aging_share(limit: int) -> int:
    """How many rows of a claim of ``limit`` go to jobs waiting past the starvation threshold:
    10 %, at least one."""
    return min(limit, max(1, limit // 10)) if limit > 0 else 0


def claim_due(
    conn: Connection,
    *,
    limit: int,
    ttl: float,
    budgets: Mapping[str, int] | None = None,
    starvation_after: float | None = None,
) -> list[Claimed]:
    """Claim up to ``limit`` due pending jobs, highest priority first, then oldest run_at, in
    one statement.

    ``FOR UPDATE SKIP LOCKED`` makes concurrent claimers take disjoint rows; each claimed row
    gets a fresh lease token and an expiry after which rescue takes it back. With ``budgets``
    ({pool: n}), no more than n jobs of each named pool are claimed (the keys it can serve
    now); it looks at most 4 x ``limit`` due rows deep for jobs it may take.

    With ``starvation_after`` (seconds), jobs due for longer than that first take up to
    :func:`aging_share` of the claim, oldest first, whatever their priority: a low-priority job
    under a flood of higher-priority ones is still claimed eventually. Returned in claim order
    (the aged share first).
    """
    if limit <= 0:
        return []
    starve = starvation_after if starvation_after is not None and starvation_after > 0 else 0.0
    params: dict[str, Any] = {
        "limit": limit,
        "ttl": ttl,
        "starve": starve,
        "share": aging_share(limit) if starve else 0,
    }
    if budgets:
        params |= {
            "scan": limit * 4,
            "pools": list(budgets),
            "budgets": [max(0, n) for n in budgets.values()],
        }
    rows = _fetch_raw(conn, _CLAIMS_SQL[bool(budgets)], params)
    aged = sorted((r for r in rows if r.aged), key=lambda r: (r.run_at, r.id))
    fresh = sorted((r for r in rows if not r.aged), key=lambda r: (-r.priority, r.run_at, r.id))
    return [Claimed(id=r.id, token=r.lease_token, queue=r.queue, name=r.name) for r in aged + fresh]


_RECENT_RUN_SECONDS = text(
    """
    SELECT name,
           percentile_cont(0.5) WITHIN GROUP (
               ORDER BY extract(epoch FROM finished_at - started_at)) AS seconds
    FROM (SELECT name, started_at, finished_at FROM harvest_jobs
          WHERE status IN ('succeeded', 'failed', 'cancelled')
          ORDER BY finished_at DESC
          LIMIT :sample) AS recent
    WHERE started_at IS NOT NULL
    GROUP BY name
    """
)


def recent_run_seconds(conn: Connection, *, sample: int = 500) -> dict[str, float]:
    """Median run time (start to finish, database clock) of each job name among the last
    ``sample`` jobs to finish (index ``harvest_jobs_finished_idx``, read backwards)."""
    rows = conn.execute(_RECENT_RUN_SECONDS, {"sample": sample})
    return {r.name: float(r.seconds) for r in rows}


# --- execution ------------------------------------------------------------------------------

_HOLD = text(
    """
    UPDATE harvest_jobs AS j
    SET lease_expires_at = now() + make_interval(secs => :ttl)
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS m(id, token)
    WHERE j.id = m.id AND j.lease_token = m.token AND j.status = 'dispatched'
    RETURNING j.id, j.name
    """
)


def hold(conn: Connection, jobs: Sequence[tuple[int, uuid.UUID]], *, ttl: float) -> dict[int, str]:
    """A worker took a message: extend the dispatch leases of its jobs whose token still
    matches (one statement); returns {job id: job name} of those held. A duplicate or stale
    delivery (job already started, finished, or re-dispatched with a new token) matches nothing
    and is left out."""
    if not jobs:
        return {}
    params = {"ids": [j[0] for j in jobs], "tokens": [j[1] for j in jobs], "ttl": ttl}
    return {int(r.id): str(r.name) for r in conn.execute(_HOLD, params)}


_START = text(
    """
    UPDATE harvest_jobs
    SET status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'running' END,
        attempts = attempts + CASE WHEN cancel_requested THEN 0 ELSE 1 END,
        started_at = now(),
        finished_at = CASE WHEN cancel_requested THEN now() END,
        lease_token = CASE WHEN cancel_requested THEN NULL ELSE lease_token END,
        lease_expires_at = CASE WHEN cancel_requested THEN NULL
                                ELSE now() + make_interval(secs => :ttl) END
    WHERE id = :id AND lease_token = :token AND status = 'dispatched'
    RETURNING id, name, payload, attempts, max_attempts, timeout, status
    """
)


def start(
    conn: Connection, job_id: int, token: uuid.UUID, *, ttl: float
) -> Started | JobStatus | None:
    """Dispatched -> running (attempt counted) if the token still matches, just before the
    handler runs. A job cancelled meanwhile ends cancelled here instead (returns
    ``JobStatus.CANCELLED``). None: the token no longer matches (a duplicate delivery)."""
    r = conn.execute(_START, {"id": job_id, "token": token, "ttl": ttl}).one_or_none()
    if r is None:
        return None
    if r.status != "running":
        return JobStatus(r.status)
    return Started(
        id=r.id,
        token=token,
        name=r.name,
        payload=r.payload,
        attempt=r.attempts,
        max_attempts=r.max_attempts,
        timeout=r.timeout,
        cancel_requested=False,
    )


_HEARTBEAT = text(
    """
    UPDATE harvest_jobs AS j
    SET lease_expires_at = now() + make_interval(secs => :ttl)
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS m(id, token)
    WHERE j.id = m.id AND j.lease_token = m.token AND j.status IN ('dispatched', 'running')
    RETURNING j.id, j.cancel_requested
    """
)


def heartbeat(
    conn: Connection, jobs: Sequence[tuple[int, uuid.UUID]], *, ttl: float
) -> dict[int, bool]:
    """Extend the leases still held (jobs running, or waiting their turn in a message this
    worker holds). Returns {job id: cancel requested} for those held."""
    if not jobs:
        return {}
    params = {"ids": [j[0] for j in jobs], "tokens": [j[1] for j in jobs], "ttl": ttl}
    return {r.id: r.cancel_requested for r in conn.execute(_HEARTBEAT, params)}


# A retry (:status 'pending') of a job someone asked to cancel ends it cancelled instead:
# harvest checks the cancel request before any retry, whether or not the handler saw it.
_FINISH = text(
    """
    UPDATE harvest_jobs
    SET status = CASE WHEN :status = 'pending' AND cancel_requested THEN 'cancelled'
                      ELSE :status END,
        result = CAST(:result AS jsonb), last_error = :error,
        last_traceback = :traceback, lease_token = NULL, lease_expires_at = NULL,
        finished_at = CASE WHEN :status = 'pending' AND NOT cancel_requested THEN NULL
                           ELSE now() END,
        run_at = CASE WHEN :status = 'pending' AND NOT cancel_requested
                      THEN now() + make_interval(secs => :delay) ELSE run_at END,
        attempts = attempts - :refund
    WHERE id = :id AND lease_token = :token AND status = 'running'
    """
)


def finish(
    conn: Connection,
    job_id: int,
    token: uuid.UUID,
    *,
    status: JobStatus,
    result_json: str | None = None,
    error: str | None = None,
    traceback: str | None = None,
    retry_delay: float = 0.0,
    refund_attempt: bool = False,
) -> bool:
    """The one fenced write that ends an attempt. False: the lease was lost, nothing written.
    A retry of a job whose cancellation was requested ends it cancelled instead.

    ``refund_attempt``: the attempt did not count (its API key was rate limited or rejected:
    not the job's fault), so it goes back to pending without using up an attempt."""
    params = {
        "id": job_id,
        "token": token,
        "status": str(status),
        "result": result_json,
        "error": error,
        "traceback": traceback,
        "delay": retry_delay,
        "refund": int(refund_attempt and status is JobStatus.PENDING),
    }
    return bool(conn.execute(_FINISH, params).rowcount == 1)


_DEFER = text(
    """
    UPDATE harvest_jobs
    SET status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'pending' END,
        finished_at = CASE WHEN cancel_requested THEN now() END,
        lease_token = NULL, lease_expires_at = NULL,
        run_at = now() + make_interval(secs => :delay)
    WHERE id = :id AND lease_token = :token AND status = 'dispatched'
    """
)


def defer(conn: Connection, job_id: int, token: uuid.UUID, *, delay: float) -> bool:
    """A held job that could not start (no API key free within a short wait) goes back to
    pending after ``delay``, without counting an attempt and without holding a worker (or
    ends cancelled, when its cancellation was requested meanwhile)."""
    return bool(conn.execute(_DEFER, {"id": job_id, "token": token, "delay": delay}).rowcount == 1)


# --- rescue ---------------------------------------------------------------------------------

_RESCUE = text(
    """
    WITH expired AS (
        SELECT id FROM harvest_jobs
        WHERE status IN ('dispatched', 'running') AND lease_expires_at < now()
        ORDER BY lease_expires_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE harvest_jobs AS j
    SET status = CASE
            WHEN j.cancel_requested THEN 'cancelled'
            WHEN j.status = 'running' AND j.attempts >= j.max_attempts THEN 'failed'
            ELSE 'pending' END,
        last_error = CASE WHEN j.status = 'running'
            THEN 'lease expired: the worker running attempt ' || j.attempts
                 || ' stopped renewing it (killed, paused or cut off)'
            ELSE j.last_error END,
        finished_at = CASE
            WHEN j.cancel_requested OR (j.status = 'running' AND j.attempts >= j.max_attempts)
            THEN now() END,
        lease_token = NULL, lease_expires_at = NULL
    FROM expired WHERE j.id = expired.id
    RETURNING j.id, j.status
    """
)


@dataclass(frozen=True, slots=True)
class Rescued:
    requeued: list[int]
    failed: list[int]
    cancelled: list[int]


def rescue_expired(conn: Connection, *, limit: int) -> Rescued:
    """Take back jobs whose lease expired: their worker died, hung or was cut off.

    A re-queued job keeps its ``run_at``: it was due long ago, so it is claimed ahead of the
    backlog that came after it (within its priority), not behind it."""
    by_status: dict[str, list[int]] = {"pending": [], "failed": [], "cancelled": []}
    for r in conn.execute(_RESCUE, {"limit": limit}):
        by_status[r.status].append(r.id)
    return Rescued(by_status["pending"], by_status["failed"], by_status["cancelled"])


# --- reading and cancelling -----------------------------------------------------------------

_JOB_COLUMNS = ", ".join(Job.__dataclass_fields__)


def get(conn: Connection, job_id: int) -> Job | None:
    row = (
        conn.execute(
            text(f"SELECT {_JOB_COLUMNS} FROM harvest_jobs WHERE id = :id"), {"id": job_id}
        )
        .mappings()
        .one_or_none()
    )
    return Job.from_row(row) if row is not None else None


def status_of(conn: Connection, job_id: int) -> JobStatus | None:
    value = conn.execute(
        text("SELECT status FROM harvest_jobs WHERE id = :id"), {"id": job_id}
    ).scalar_one_or_none()
    return JobStatus(value) if value is not None else None


_CANCEL = text(
    """
    UPDATE harvest_jobs
    SET status = CASE WHEN status = 'pending' THEN 'cancelled' ELSE status END,
        finished_at = CASE WHEN status = 'pending' THEN now() ELSE finished_at END,
        cancel_requested = status IN ('pending', 'dispatched', 'running')
    WHERE id = :id AND status NOT IN ('succeeded', 'failed', 'cancelled')
    RETURNING status
    """
)


def cancel(conn: Connection, job_id: int) -> JobStatus | None:
    """Pending -> cancelled at once; dispatched or running -> cancel requested (the worker
    stops it). Returns the status after the call, or None if the job was already terminal."""
    value = conn.execute(_CANCEL, {"id": job_id}).scalar_one_or_none()
    return JobStatus(value) if value is not None else None


def list_jobs(
    conn: Connection,
    *,
    status: str | None = None,
    name: str | None = None,
    limit: int = 50,
) -> list[Job]:
    clauses: list[str] = []
    params: dict[str, Any] = {"limit": limit}
    if status is not None:
        clauses.append("status = :status")
        params["status"] = status
    if name is not None:
        clauses.append("name = :name")
        params["name"] = name
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    sql = f"SELECT {_JOB_COLUMNS} FROM harvest_jobs {where} ORDER BY id DESC LIMIT :limit"
    return [Job.from_row(r) for r in conn.execute(text(sql), params).mappings()]


# --- counters -------------------------------------------------------------------------------

_BUMP = text(
    """
    INSERT INTO harvest_counters (name, value) VALUES (:name, :n)
    ON CONFLICT (name) DO UPDATE SET value = harvest_counters.value + EXCLUDED.value
    """
)


def bump(conn: Connection, name: str, n: int = 1) -> None:
    if n:
        conn.execute(_BUMP, {"name": name, "n": n})


def counters(conn: Connection) -> dict[str, int]:
    rows = conn.execute(text("SELECT name, value FROM harvest_counters"))
    return {r.name: int(r.value) for r in rows}


def counts_by_status(conn: Connection, names: Iterable[str] | None = None) -> dict[str, int]:
    if names is None:
        rows = conn.execute(text("SELECT status, count(*) AS n FROM harvest_jobs GROUP BY status"))
    else:
        rows = conn.execute(
            text(
                "SELECT status, count(*) AS n FROM harvest_jobs "
                "WHERE name = ANY(:names) GROUP BY status"
            ),
            {"names": list(names)},
        )
    return {r.status: int(r.n) for r in rows}


# --- figures for stats, the demo summary and metrics -----------------------------------------

_DEPTH = text("SELECT queue, status, count(*) AS n FROM harvest_jobs GROUP BY queue, status")


def depth(conn: Connection) -> list[tuple[str, str, int]]:
    return [(r.queue, r.status, int(r.n)) for r in conn.execute(_DEPTH)]


_WINDOW = text(
    """
    SELECT
      count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
      count(*) FILTER (WHERE status = 'failed') AS failed,
      count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
      count(*) FILTER (WHERE attempts > 1) AS retried,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM started_at - run_at))
          FILTER (WHERE attempts = 1 AND started_at IS NOT NULL) AS wait_p,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM finished_at - started_at))
          FILTER (WHERE status = 'succeeded') AS run_p,
      extract(epoch FROM max(finished_at) - min(created_at)) AS span
    FROM harvest_jobs
    WHERE finished_at >= now() - make_interval(secs => :seconds)
      AND (CAST(:ids AS bigint[]) IS NULL OR id = ANY(CAST(:ids AS bigint[])))
    """
)


@dataclass(frozen=True, slots=True)
class Window:
    """Jobs that ended within a window (or among given ids): outcome counts and latencies."""

    succeeded: int
    failed: int
    cancelled: int
    retried: int
    wait_p: tuple[float, float, float] | None  # enqueue (due) to start: p50, p95, p99 seconds
    run_p: tuple[float, float, float] | None  # start to finish of successful attempts
    span: float | None  # first created to last finished, seconds


def window(conn: Connection, *, seconds: float, ids: Sequence[int] | None = None) -> Window:
    r = conn.execute(_WINDOW, {"seconds": seconds, "ids": list(ids) if ids else None}).one()

    def triple(v: Any) -> tuple[float, float, float] | None:
        return (float(v[0]), float(v[1]), float(v[2])) if v else None

    return Window(
        int(r.succeeded),
        int(r.failed),
        int(r.cancelled),
        int(r.retried),
        triple(r.wait_p),
        triple(r.run_p),
        float(r.span) if r.span is not None else None,
    )


def status_counts(conn: Connection, ids: Sequence[int]) -> dict[str, int]:
    """Jobs among ``ids`` by status."""
    rows = conn.execute(
        text("SELECT status, count(*) FROM harvest_jobs WHERE id = ANY(:ids) GROUP BY status"),
        {"ids": list(ids)},
    )
    return {r[0]: int(r[1]) for r in rows}


_RETRY_FAILED = text(
    """
    UPDATE harvest_jobs
    SET status = 'pending', run_at = now(), finished_at = NULL,
        max_attempts = greatest(max_attempts, attempts + 1)
    WHERE id = :id AND status = 'failed'
    """
)


def retry_failed(conn: Connection, job_id: int) -> bool:
    """A dead job back to pending with one more attempt allowed; its last error is kept."""
    return bool(conn.execute(_RETRY_FAILED, {"id": job_id}).rowcount == 1)


_RETRY_FAILED_MANY = text(
    """
    WITH chosen AS (
        SELECT id FROM harvest_jobs
        WHERE status = 'failed' AND (CAST(:name AS text) IS NULL OR name = CAST(:name AS text))
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE harvest_jobs AS j
    SET status = 'pending', run_at = now(), finished_at = NULL,
        max_attempts = greatest(j.max_attempts, j.attempts + 1)
    FROM chosen WHERE j.id = chosen.id
    RETURNING j.id
    """
)


def retry_failed_many(conn: Connection, *, name: str | None = None, limit: int = 1000) -> list[int]:
    """Up to ``limit`` dead jobs (of one name, or all) back to pending, one statement."""
    rows = conn.execute(_RETRY_FAILED_MANY, {"name": name, "limit": limit})
    return [int(i) for i in rows.scalars()]


# --- backpressure: depth of pending jobs ------------------------------------------------------

# Transaction-scoped advisory locks, one per (queue or job name): enqueues that count exactly
# take it exclusively, enqueues that trust a recent count take it shared. An exact count thus
# waits for every insert in flight, and no two exact counts admit the same room twice.
_LOCK_CLASS = 0x68767374  # "hvst": the advisory lock class of depth checks
_DEPTH_LOCK_SHARED = text("SELECT pg_advisory_xact_lock_shared(:cls, hashtext(:key))")
_DEPTH_LOCK = text("SELECT pg_advisory_xact_lock(:cls, hashtext(:key))")
_DEPTH_OF_QUEUE = text("SELECT count(*) FROM harvest_jobs WHERE status = 'pending' AND queue = :v")
_DEPTH_OF_NAME = text("SELECT count(*) FROM harvest_jobs WHERE status = 'pending' AND name = :v")


def lock_depth(conn: Connection, key: str, *, exclusive: bool) -> None:
    """Take the depth lock of ``key`` (``queue:<q>`` or ``job:<name>``) until the transaction
    ends; take several in sorted order."""
    conn.execute(_DEPTH_LOCK if exclusive else _DEPTH_LOCK_SHARED, {"cls": _LOCK_CLASS, "key": key})


def pending_depth(conn: Connection, key: str) -> int:
    """Pending jobs of ``queue:<q>`` or ``job:<name>`` (an index-only count)."""
    kind, _, value = key.partition(":")
    statement = _DEPTH_OF_QUEUE if kind == "queue" else _DEPTH_OF_NAME
    return int(conn.execute(statement, {"v": value}).scalar_one())


def find_by_idempotency_key(conn: Connection, key: str) -> int | None:
    value = conn.execute(
        text("SELECT id FROM harvest_jobs WHERE idempotency_key = :k"), {"k": key}
    ).scalar_one_or_none()
    return int(value) if value is not None else None


# --- batches ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewBatch:
    total: int
    callback_name: str | None
    callback_queue: str | None
    callback_payload_json: str
    callback_priority: int
    callback_max_attempts: int
    callback_timeout: float | None
    callback_pool: str | None


_INSERT_BATCH = text(
    """
    INSERT INTO harvest_batches (total, callback_name, callback_queue, callback_payload,
                                 callback_priority, callback_max_attempts, callback_timeout,
                                 callback_pool)
    VALUES (:total, :name, :queue, CAST(:payload AS jsonb), :priority, :max_attempts, :timeout,
            :pool)
    RETURNING id
    """
)

_INSERT_ROWS = text(
    """
    INSERT INTO harvest_jobs (name, queue, payload, priority, run_at, max_attempts, timeout, pool,
                              batch_id)
    SELECT t.name, t.queue, t.payload, :priority,
           COALESCE(CAST(:run_at AS timestamptz),
                    now() + make_interval(secs => COALESCE(CAST(:delay AS float8), 0))),
           t.max_attempts, t.timeout, t.pool, :batch_id
    FROM unnest(CAST(:names AS text[]), CAST(:queues AS text[]), CAST(:payloads AS jsonb[]),
                CAST(:max_attempts AS int[]), CAST(:timeouts AS float8[]), CAST(:pools AS text[]))
         WITH ORDINALITY AS t(name, queue, payload, max_attempts, timeout, pool, ord)
    ORDER BY t.ord
    RETURNING id
    """
)


def insert_batch(conn: Connection, batch: NewBatch) -> int:
    """The batch row (before its members: the trigger counts members against it)."""
    params = {
        "total": batch.total,
        "name": batch.callback_name,
        "queue": batch.callback_queue,
        "payload": batch.callback_payload_json,
        "priority": batch.callback_priority,
        "max_attempts": batch.callback_max_attempts,
        "timeout": batch.callback_timeout,
        "pool": batch.callback_pool,
    }
    return int(conn.execute(_INSERT_BATCH, params).scalar_one())


def insert_rows(
    conn: Connection, jobs: Sequence[NewJob], *, batch_id: int | None = None
) -> list[int]:
    """Insert jobs of several names in one statement; priority, run_at and delay are taken from
    the first job (a batch shares them). Returns ids in order."""
    if not jobs:
        return []
    first = jobs[0]
    params = {
        "priority": first.priority,
        "run_at": first.run_at,
        "delay": first.delay,
        "batch_id": batch_id,
        "names": [j.name for j in jobs],
        "queues": [j.queue for j in jobs],
        "payloads": [j.payload_json for j in jobs],
        "max_attempts": [j.max_attempts for j in jobs],
        "timeouts": [j.timeout for j in jobs],
        "pools": [j.pool for j in jobs],
    }
    return [int(i) for i in conn.execute(_INSERT_ROWS, params).scalars()]


def get_batch(conn: Connection, batch_id: int) -> RowMapping | None:
    return (
        conn.execute(text("SELECT * FROM harvest_batches WHERE id = :id"), {"id": batch_id})
        .mappings()
        .one_or_none()
    )


# --- recurring schedules ------------------------------------------------------------------------

_SCHEDULE_COLUMNS = (
    "id, name, job_name, payload, cron, every_seconds, timezone, enabled, misfire, catch_up, "
    "priority, next_run_at, last_fired_at, created_at, updated_at"
)

_CLAIM_SCHEDULE = text(
    f"""
    SELECT {_SCHEDULE_COLUMNS}, now() AS now
    FROM harvest_schedules
    WHERE enabled AND next_run_at <= now() AND id <> ALL(CAST(:skip AS bigint[]))
    ORDER BY next_run_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
    """
)


def claim_due_schedule(conn: Connection, *, skip: Sequence[int] = ()) -> RowMapping | None:
    """Lock one due, enabled schedule (SKIP LOCKED: another schedule worker holding one makes
    this one take the next). The row (with the database's ``now``) or None."""
    return conn.execute(_CLAIM_SCHEDULE, {"skip": list(skip)}).mappings().one_or_none()


# The fire records and the jobs, in one statement: a fire time already recorded (by any worker,
# ever) inserts nothing, so it enqueues nothing. Job ids are drawn first so that each record
# names its job.
_FIRE = text(
    """
    WITH fired AS (
        INSERT INTO harvest_schedule_fires (schedule_id, fire_at, job_id)
        SELECT :schedule_id, t, nextval(pg_get_serial_sequence('harvest_jobs', 'id'))
        FROM unnest(CAST(:times AS timestamptz[])) AS t
        ON CONFLICT (schedule_id, fire_at) DO NOTHING
        RETURNING fire_at, job_id
    )
    INSERT INTO harvest_jobs (id, name, queue, payload, priority, run_at, max_attempts, timeout,
                              pool)
    SELECT job_id, :name, :queue, CAST(:payload AS jsonb), :priority, fire_at, :max_attempts,
           :timeout, :pool
    FROM fired ORDER BY fire_at
    RETURNING id
    """
)


def fire_schedule(
    conn: Connection, schedule_id: int, times: Sequence[datetime], job: NewJob
) -> list[int]:
    """One job per fire time not recorded yet (``job.run_at`` is replaced by the fire time).
    Returns the new jobs' ids."""
    if not times:
        return []
    params = _params(job) | {"schedule_id": schedule_id, "times": list(times)}
    return [int(i) for i in conn.execute(_FIRE, params).scalars()]


def advance_schedule(
    conn: Connection, schedule_id: int, *, next_run_at: datetime, fired_at: datetime | None
) -> None:
    conn.execute(
        text(
            "UPDATE harvest_schedules SET next_run_at = :next, "
            "last_fired_at = COALESCE(CAST(:fired AS timestamptz), last_fired_at) WHERE id = :id"
        ),
        {"id": schedule_id, "next": next_run_at, "fired": fired_at},
    )


def get_or_create_schedule(
    session: Session, name: str, values: Mapping[str, Any]
) -> tuple[int, bool]:
    """The schedule named ``name``, created from ``values`` when missing. (id, created)."""
    row, created = get_or_create(session, ScheduleRow, lookup={"name": name}, defaults=values)
    return row.id, created


def get_schedule(conn: Connection, name: str) -> RowMapping | None:
    return (
        conn.execute(
            text(f"SELECT {_SCHEDULE_COLUMNS} FROM harvest_schedules WHERE name = :name"),
            {"name": name},
        )
        .mappings()
        .one_or_none()
    )


def lock_schedule(conn: Connection, name: str) -> RowMapping | None:
    """The schedule's row, locked until the transaction ends (waits for a firing tick), with
    the database's ``now``."""
    return (
        conn.execute(
            text(
                f"SELECT {_SCHEDULE_COLUMNS}, now() AS now FROM harvest_schedules "
                "WHERE name = :name FOR UPDATE"
            ),
            {"name": name},
        )
        .mappings()
        .one_or_none()
    )


def list_schedules(conn: Connection) -> list[RowMapping]:
    return list(
        conn.execute(
            text(f"SELECT {_SCHEDULE_COLUMNS} FROM harvest_schedules ORDER BY name")
        ).mappings()
    )


_SCHEDULE_FIELDS = frozenset(
    {
        "job_name", "payload", "cron", "every_seconds", "timezone", "enabled", "misfire",
        "catch_up", "priority", "next_run_at",
    }
)  # fmt: skip


def update_schedule(conn: Connection, schedule_id: int, values: Mapping[str, Any]) -> None:
    """Set the given fields (names from a fixed set; payload as JSON text)."""
    unknown = set(values) - _SCHEDULE_FIELDS
    if unknown:
        raise ValueError(f"not schedule fields: {sorted(unknown)}")
    sets = [
        f"{column} = CAST(:{column} AS jsonb)" if column == "payload" else f"{column} = :{column}"
        for column in values
    ]
    conn.execute(
        text(f"UPDATE harvest_schedules SET {', '.join(sets)}, updated_at = now() WHERE id = :id"),
        {**values, "id": schedule_id},
    )


def delete_schedule(conn: Connection, name: str) -> bool:
    """Delete a schedule and its fire records; False when there was none."""
    result = conn.execute(text("DELETE FROM harvest_schedules WHERE name = :name"), {"name": name})
    return bool(result.rowcount)


def db_now(conn: Connection) -> datetime:
    value: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return value


# --- retention ----------------------------------------------------------------------------------


def _prune_jobs_statement(statuses: str) -> TextClause:
    # Literal statuses so the planner proves the partial index harvest_jobs_finished_idx.
    return text(
        f"""
        DELETE FROM harvest_jobs WHERE id IN (
            SELECT id FROM harvest_jobs
            WHERE status IN {statuses}
              AND finished_at < now() - make_interval(secs => :age)
            ORDER BY finished_at
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        )
        """
    )


_PRUNE_FINISHED = _prune_jobs_statement("('succeeded', 'cancelled')")
_PRUNE_DEAD = _prune_jobs_statement("('failed')")

_PRUNE_FIRES = text(
    """
    DELETE FROM harvest_schedule_fires WHERE (schedule_id, fire_at) IN (
        SELECT schedule_id, fire_at FROM harvest_schedule_fires
        WHERE fire_at < now() - make_interval(secs => :age)
        ORDER BY fire_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)

_PRUNE_BATCHES = text(
    """
    DELETE FROM harvest_batches WHERE id IN (
        SELECT id FROM harvest_batches
        WHERE completed_at < now() - make_interval(secs => :age)
        ORDER BY completed_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)

_PRUNES = {
    "finished": _PRUNE_FINISHED,
    "dead": _PRUNE_DEAD,
    "fires": _PRUNE_FIRES,
    "batches": _PRUNE_BATCHES,
}


def prune(conn: Connection, what: str, *, older_than: float, limit: int) -> int:
    """Delete up to ``limit`` rows of one kind that ended more than ``older_than`` seconds ago
    (``finished``: succeeded and cancelled jobs; ``dead``: failed jobs; ``fires``: schedule fire
    records; ``batches``: completed batches). Rows locked by anyone are skipped, and only
    terminal jobs are touched, so this never waits on (or blocks) the claim path."""
    result = conn.execute(_PRUNES[what], {"age": older_than, "limit": limit})
    return int(result.rowcount)


# --- what the dashboard reads and deletes ----------------------------------------------------


def list_jobs_page(
    conn: Connection,
    *,
    status: str | None = None,
    name: str | None = None,
    queue: str | None = None,
    batch_id: int | None = None,
    before: int | None = None,
    after: int | None = None,
    limit: int = 50,
) -> list[Job]:
    """Jobs matching the filters, keyset-paginated by id: newest first below ``before`` (or
    from the newest), or, with ``after``, the oldest ``limit`` above ``after`` (ascending: the
    caller reverses them)."""
    clauses: list[str] = []
    params: dict[str, Any] = {"limit": limit}
    for column, value in (("status", status), ("name", name), ("queue", queue)):
        if value is not None:
            clauses.append(f"{column} = :{column}")
            params[column] = value
    if batch_id is not None:
        clauses.append("batch_id = :batch_id")
        params["batch_id"] = batch_id
    if before is not None:
        clauses.append("id < :before")
        params["before"] = before
    if after is not None:
        clauses.append("id > :after")
        params["after"] = after
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    order = "ASC" if after is not None else "DESC"
    sql = f"SELECT {_JOB_COLUMNS} FROM harvest_jobs {where} ORDER BY id {order} LIMIT :limit"
    return [Job.from_row(r) for r in conn.execute(text(sql), params).mappings()]


_MINUTES = text(
    """
    SELECT date_trunc('minute', finished_at) AS minute,
      count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
      count(*) FILTER (WHERE status = 'failed') AS failed,
      count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM started_at - run_at))
          FILTER (WHERE attempts = 1 AND started_at IS NOT NULL) AS wait_p,
      percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
          ORDER BY extract(epoch FROM finished_at - started_at))
          FILTER (WHERE status = 'succeeded' AND started_at IS NOT NULL) AS run_p
    FROM harvest_jobs
    WHERE status IN ('succeeded', 'failed', 'cancelled')
      AND finished_at >= date_trunc('minute', now()) - make_interval(mins => :minutes - 1)
    GROUP BY 1
    ORDER BY 1
    """
)


def minute_rows(conn: Connection, *, minutes: int) -> tuple[datetime, list[Any]]:
    """Jobs that ended in each of the last ``minutes`` minutes (the current one included):
    outcome counts and p50/p95/p99 of enqueue-to-start and run time. Returns the database's
    current minute and the rows of minutes that had any."""
    current: datetime = conn.execute(text("SELECT date_trunc('minute', now())")).scalar_one()
    return current, list(conn.execute(_MINUTES, {"minutes": minutes}))


_DELETE_DEAD = text("DELETE FROM harvest_jobs WHERE id = :id AND status = 'failed'")

_DELETE_DEAD_MANY = text(
    """
    DELETE FROM harvest_jobs WHERE id IN (
        SELECT id FROM harvest_jobs
        WHERE status = 'failed' AND (CAST(:name AS text) IS NULL OR name = CAST(:name AS text))
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)


def delete_failed(conn: Connection, job_id: int) -> bool:
    """Delete one dead (failed) job. False when it is not failed (or gone)."""
    return bool(conn.execute(_DELETE_DEAD, {"id": job_id}).rowcount == 1)


def delete_failed_many(conn: Connection, *, name: str | None, limit: int) -> int:
    """Delete up to ``limit`` dead jobs (of one name, or all), skipping locked rows."""
    return int(conn.execute(_DELETE_DEAD_MANY, {"name": name, "limit": limit}).rowcount)


def list_batches(conn: Connection, *, before: int | None, limit: int) -> list[RowMapping]:
    """Batches, newest first, below id ``before``."""
    rows = conn.execute(
        text(
            "SELECT * FROM harvest_batches WHERE (CAST(:before AS bigint) IS NULL "
            "OR id < CAST(:before AS bigint)) ORDER BY id DESC LIMIT :limit"
        ),
        {"before": before, "limit": limit},
    ).mappings()
    return list(rows)
