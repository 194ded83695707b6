"""Statements that put jobs in: one job, many by COPY, batches, and the depth checks of
backpressure that guard an enqueue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg import Connection as PgConnection
from sqlalchemy import Connection, RowMapping, Text, cast, literal, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from harvest.db import get_or_create
from harvest.execution import sql as statements
from harvest.models import JobRow
from harvest.store import history_rows

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
    tenant: str | None = None  # fairness key; None: the jobs without one


_ONE_COLUMNS = "name, queue, payload, priority, run_at, max_attempts, timeout, pool, tenant"
_ONE_VALUES = """:name, :queue, CAST(:payload AS jsonb), :priority,
            COALESCE(CAST(:run_at AS timestamptz),
                     now() + make_interval(secs => COALESCE(CAST(:delay AS float8), 0))),
            :max_attempts, :timeout, :pool, :tenant"""
_INSERT_ONE = text(f"INSERT INTO harvest_jobs ({_ONE_COLUMNS}) VALUES ({_ONE_VALUES}) RETURNING id")

# One job in one statement, committed by itself: the shared depth locks of its limits first,
# in order (the MATERIALIZED door is read before the row is made; a NULL second key takes no
# lock: the function is strict), then the row; both end with the statement's own
# transaction, as they would with a transaction of several statements. Two keys as two
# parameters, not an array: unnest of an array parameter cost 40 us more a statement.
_INSERT_ADMITTED = statements.psycopg_style(
    f"""
    WITH door AS MATERIALIZED (
        SELECT pg_advisory_xact_lock_shared(:cls, hashtext(:first)) AS first,
               pg_advisory_xact_lock_shared(:cls, hashtext(:second)) AS second
    )
    INSERT INTO harvest_jobs ({_ONE_COLUMNS}) SELECT {_ONE_VALUES} FROM door RETURNING id
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
        "tenant": job.tenant,
    }


def json_value(json_text: str) -> Any:
    """Checked JSON text as an ORM column value, as it is (not re-encoded by the ORM: a large
    float written in full must stay so, see harvest.validation)."""
    return cast(literal(json_text, Text), JSONB)


def insert_admitted(conn: Connection | PgConnection[Any], job: NewJob, keys: Sequence[str]) -> int:
    """Insert ``job`` (without an idempotency key) in one round trip on an autocommit
    connection (SQLAlchemy's, or psycopg's: :func:`harvest.db.autocommit_driver`), under the
    shared depth locks of ``keys`` (one or two, sorted; see :func:`lock_depth`): the enqueue
    whose limits are far from full. Returns its id."""
    if not 1 <= len(keys) <= 2:
        raise ValueError(f"a job counts against one or two depth limits, not {len(keys)}")
    second = keys[1] if len(keys) == 2 else None
    params = _params(job) | {"cls": _LOCK_CLASS, "first": keys[0], "second": second}
    query = statements.Query(_INSERT_ADMITTED, params, lambda rows: int(rows[0].id))
    return statements.run(conn, query)


def insert_job(session: Session, job: NewJob) -> tuple[int, bool]:
    """Insert one job; with an idempotency key, get-or-create on it. Returns (id, created)."""
    if job.idempotency_key is None:
        return int(session.execute(_INSERT_ONE, _params(job)).scalar_one()), True
    defaults = {
        "name": job.name,
        "queue": job.queue,
        "payload": json_value(job.payload_json),
        "priority": job.priority,
        "max_attempts": job.max_attempts,
        "timeout": job.timeout,
        "pool": job.pool,
        "tenant": job.tenant,
    }
    if job.run_at is not None:
        defaults["run_at"] = job.run_at
    elif job.delay:
        defaults["run_at"] = text(f"now() + make_interval(secs => {float(job.delay)!r})")
    row, created = get_or_create(
        session, JobRow, lookup={"idempotency_key": job.idempotency_key}, defaults=defaults
    )
    if created:
        # The key's job may have moved to the history since the lookup (a move commits in one
        # statement, and this statement sees it): that job is the answer, not ours.
        moved = history_rows.keyed(session.connection(), job.idempotency_key)
        if moved is not None:
            session.execute(text("DELETE FROM harvest_jobs WHERE id = :id"), {"id": row.id})
            return moved, False
    return row.id, created


# The sequence is looked up once (MATERIALIZED), not for each id: as an argument of nextval,
# pg_get_serial_sequence ran once a row and was six times the cost of the ids themselves
# (41 against 6 ms for 20,000).
_RESERVE_IDS = text(
    """
    WITH s AS MATERIALIZED (
        SELECT CAST(pg_get_serial_sequence('harvest_jobs', 'id') AS regclass) AS seq
    )
    SELECT array_agg(nextval(s.seq)) AS ids, now() AS now FROM s, generate_series(1, :n)
    """
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
    t = template
    # The columns every row shares, formatted once; each row adds its id and payload. COPY's
    # text format: tab-separated, \N for NULL, backslashes doubled (the JSON text has no raw
    # tab or newline: json escapes them inside strings). A column whose value is the table's
    # default is left to it: Postgres parses each value sent for every row (a timestamp's
    # parse was a tenth of the COPY), and a job due now gets the same ``now()`` either way.
    shared: dict[str, Any] = {"max_attempts": t.max_attempts, "timeout": t.timeout}
    if t.priority != 0:
        shared["priority"] = t.priority
    if t.run_at is not None or t.delay:
        shared["run_at"] = t.run_at or reserved.now + timedelta(seconds=t.delay or 0.0)
    if t.pool is not None:
        shared["pool"] = t.pool
    if t.tenant is not None:
        shared["tenant"] = t.tenant
    head = "\t".join(_copy_text(v) for v in (t.name, t.queue))
    tail = "\t".join(_copy_text(v) for v in shared.values())
    statement = f"COPY harvest_jobs (id, name, queue, payload, {', '.join(shared)}) FROM STDIN"
    raw = conn.connection.driver_connection
    assert raw is not None
    rows = list(zip(ids, payloads_json, strict=True))
    with raw.cursor() as cur, cur.copy(statement) as copy:
        for start in range(0, len(rows), COPY_ROWS_PER_WRITE):
            copy.write(
                "".join(
                    f"{job_id}\t{head}\t{payload.replace(BACKSLASH, BACKSLASH * 2)}\t{tail}\n"
                    for job_id, payload in rows[start : start + COPY_ROWS_PER_WRITE]
                )
            )
    return ids


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


# The jobs table and the history: a job moved since it was enqueued still holds its key.
_BY_KEY = text("SELECT id FROM harvest_jobs_all WHERE idempotency_key = :k ORDER BY id LIMIT 1")


def find_by_idempotency_key(conn: Connection, key: str) -> int | None:
    value = conn.execute(_BY_KEY, {"k": key}).scalar_one_or_none()
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
                              batch_id, tenant)
    SELECT t.name, t.queue, t.payload, :priority,
           COALESCE(CAST(:run_at AS timestamptz),
                    now() + make_interval(secs => COALESCE(CAST(:delay AS float8), 0))),
           t.max_attempts, t.timeout, t.pool, :batch_id, :tenant
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
    """Insert jobs of several names in one statement; priority, run_at, delay and tenant are
    taken from the first job (a batch shares them). Returns ids in order."""
    if not jobs:
        return []
    first = jobs[0]
    params = {
        "priority": first.priority,
        "run_at": first.run_at,
        "delay": first.delay,
        "tenant": first.tenant,
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
