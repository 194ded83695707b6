"""The partitioned history of finished jobs (migration 0013): moving jobs into it, the day
partitions it needs, dropping the days past retention, and reviving a dead job from it.

A job is in ``harvest_jobs`` or in ``harvest_job_history``, never both: a move is one statement
(``DELETE ... RETURNING`` feeding an ``INSERT``), so a reader of ``harvest_jobs_all`` (one
snapshot) sees it in exactly one. Moves take only finished rows, choose them ``FOR UPDATE SKIP
LOCKED`` and never wait on (or block) the claim, which reads pending rows only.

The history is partitioned by kind (``done``: succeeded and cancelled; ``dead``: failed, kept
longer) and by UTC day of ``finished_at``. A move only takes rows whose day partition exists
(made just before, in its own short transaction), so no row can miss a partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, text

from harvest.models import JobRow

PARENT = "harvest_job_history"
KINDS = {"done": "('succeeded', 'cancelled')", "dead": "('failed')"}
DAY = timedelta(days=1)
LOCK_TIMEOUT = "2s"  # a partition is made or dropped only if that takes no longer to lock

COLUMNS = ", ".join(c.name for c in JobRow.__table__.columns)
_MOVED_COLUMNS = ", ".join(f"m.{c.name}" for c in JobRow.__table__.columns)


def partition_name(kind: str, day: datetime) -> str:
    return f"{PARENT}_{kind}_{day.astimezone(UTC):%Y%m%d}"


def _due(kind: str) -> str:
    # Literal statuses, so that the planner proves the partial index harvest_jobs_finished_idx.
    return f"""
        status IN {KINDS[kind]}
        AND finished_at < now() - make_interval(secs => :after)
        AND finished_at >= now() - make_interval(secs => :retention)
    """


def _days_statement(kind: str) -> str:
    return f"""
        SELECT DISTINCT date_trunc('day', finished_at, 'UTC') AS day FROM (
            SELECT finished_at FROM harvest_jobs WHERE {_due(kind)}
            ORDER BY finished_at LIMIT :limit
        ) AS due
    """


def _move_statement(kind: str) -> str:
    return f"""
        WITH moved AS (
            DELETE FROM harvest_jobs WHERE id IN (
                SELECT id FROM harvest_jobs
                WHERE {_due(kind)} AND finished_at >= :lo AND finished_at < :hi
                ORDER BY finished_at
                LIMIT :limit
                FOR UPDATE SKIP LOCKED
            )
            RETURNING *
        )
        INSERT INTO {PARENT} ({COLUMNS}, attempt_log)
        SELECT {_MOVED_COLUMNS}, (
            SELECT jsonb_agg(jsonb_build_object(
                'attempt', a.attempt, 'worker', a.worker, 'started_at', a.started_at,
                'ended_at', a.ended_at, 'outcome', a.outcome, 'error', a.error)
                ORDER BY a.ended_at, a.id)
            FROM harvest_job_attempts AS a WHERE a.job_id = m.id
        )
        FROM moved AS m
    """


_DAYS = {kind: text(_days_statement(kind)) for kind in KINDS}
_MOVE = {kind: text(_move_statement(kind)) for kind in KINDS}


def days_due(
    conn: Connection, kind: str, *, after: float, retention: float, limit: int
) -> list[datetime]:
    """The UTC days of the next ``limit`` rows of ``kind`` due to move (oldest first): those
    that ended more than ``after`` seconds ago and are not yet past ``retention``."""
    params = {"after": after, "retention": retention, "limit": limit}
    # In UTC whatever the session's TimeZone: a partition's name is its UTC day.
    return sorted(day.astimezone(UTC) for day in conn.execute(_DAYS[kind], params).scalars())


def has_partition(conn: Connection, kind: str, day: datetime) -> bool:
    name = partition_name(kind, day)
    return conn.execute(text("SELECT to_regclass(:n)"), {"n": name}).scalar() is not None


def make_partition(conn: Connection, kind: str, day: datetime) -> None:
    """The day partition of ``kind``, made apart and then attached: ``ATTACH PARTITION`` locks
    the parent only against other DDL (SHARE UPDATE EXCLUSIVE), so readers and moves go on, and
    an empty table needs no validation scan. Run in a transaction of its own."""
    name = partition_name(kind, day)
    parent = f"{PARENT}_{kind}"
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    conn.execute(
        text(
            f"CREATE TABLE IF NOT EXISTS {name} "
            f"(LIKE {parent} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        )
    )
    bounds = f"FROM ('{day.isoformat()}') TO ('{(day + DAY).isoformat()}')"
    conn.execute(text(f"ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES {bounds}"))


def move(
    conn: Connection,
    kind: str,
    *,
    after: float,
    retention: float,
    days: Sequence[datetime],
    limit: int,
) -> int:
    """Move up to ``limit`` due rows of ``kind`` that ended within ``days`` (whose partitions
    exist) into the history, oldest first, with their attempts. Returns how many moved."""
    params = {
        "after": after,
        "retention": retention,
        "lo": min(days),
        "hi": max(days) + DAY,
        "limit": limit,
    }
    return int(conn.execute(_MOVE[kind], params).rowcount)


_PARTITIONS = text(
    """
    SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
    WHERE i.inhparent = CAST(:parent AS regclass) ORDER BY c.relname
    """
)


def partitions(conn: Connection, kind: str) -> list[tuple[str, datetime]]:
    """The day partitions of ``kind``: (name, day), oldest first."""
    names = conn.execute(_PARTITIONS, {"parent": f"{PARENT}_{kind}"}).scalars()
    found = []
    for name in names:
        try:
            day = datetime.strptime(name.rsplit("_", 1)[-1], "%Y%m%d").replace(tzinfo=UTC)
        except ValueError:
            continue  # not one of ours
        found.append((name, day))
    return found


def droppable(conn: Connection, kind: str, *, retention: float) -> list[str]:
    """Partitions of ``kind`` whose every row is past ``retention`` (the day ended that long
    ago, by the database's clock)."""
    now = conn.execute(text("SELECT now()")).scalar_one()
    horizon = now - timedelta(seconds=retention)
    return [name for name, day in partitions(conn, kind) if day + DAY <= horizon]


def drop_partition(conn: Connection, name: str) -> None:
    """Drop one day partition (a catalog change: no row is deleted, nothing left to vacuum).
    Run in a transaction of its own; gives up after :data:`LOCK_TIMEOUT` waiting for readers."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    conn.execute(text(f"DROP TABLE IF EXISTS {name}"))


# --- dead jobs in the history: retried (moved back) or deleted ---------------------------------

# Dead jobs of the history (these ids, or of one name, or any), oldest first, locked rows skipped.
_CHOOSE_DEAD = f"""
    SELECT id FROM {PARENT}
    WHERE status = 'failed'
      AND (CAST(:ids AS bigint[]) IS NULL OR id = ANY(CAST(:ids AS bigint[])))
      AND (CAST(:name AS text) IS NULL OR name = CAST(:name AS text))
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
"""

_REVIVE = text(
    f"""
    WITH m AS (
        DELETE FROM {PARENT} WHERE id IN ({_CHOOSE_DEAD}) RETURNING *
    ), job AS (
        INSERT INTO harvest_jobs ({COLUMNS}) SELECT {_MOVED_COLUMNS} FROM m AS m RETURNING id
    ), attempt AS (
        INSERT INTO harvest_job_attempts
            (job_id, attempt, worker, started_at, ended_at, outcome, error)
        SELECT m.id, a.attempt, a.worker, a.started_at, a.ended_at, a.outcome, a.error
        FROM m AS m CROSS JOIN LATERAL jsonb_to_recordset(coalesce(m.attempt_log, '[]'))
            AS a(attempt integer, worker text, started_at timestamptz, ended_at timestamptz,
                 outcome text, error text)
        RETURNING 1
    )
    SELECT id FROM job ORDER BY id
    """
)


def revive_dead(
    conn: Connection, *, ids: Sequence[int] | None = None, name: str | None = None, limit: int
) -> list[int]:
    """Dead jobs of the history (these ids, or of one name, or any) back into ``harvest_jobs``
    as they were (still failed, attempts restored), so that a retry is the same UPDATE there
    as for a job that never moved (and batches count it the same way)."""
    params = {"ids": list(ids) if ids is not None else None, "name": name, "limit": limit}
    return [int(i) for i in conn.execute(_REVIVE, params).scalars()]


_DELETE_DEAD = text(
    f"""
    DELETE FROM {PARENT} WHERE id IN ({_CHOOSE_DEAD})
    """
)


def delete_dead(
    conn: Connection, *, ids: Sequence[int] | None = None, name: str | None = None, limit: int
) -> int:
    """Delete dead jobs from the history (these ids, or of one name, or any)."""
    params = {"ids": list(ids) if ids is not None else None, "name": name, "limit": limit}
    return int(conn.execute(_DELETE_DEAD, params).rowcount)


_KEYED = text(f"SELECT id FROM {PARENT} WHERE idempotency_key = :k ORDER BY id LIMIT 1")


def keyed(conn: Connection, key: str) -> int | None:
    """The job in the history that holds idempotency key ``key``, if any."""
    value = conn.execute(_KEYED, {"k": key}).scalar_one_or_none()
    return int(value) if value is not None else None
