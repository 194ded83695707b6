"""Reading jobs: every stored value read so that none can fail to load (an unfinished row
holding one is quarantined), single jobs, listings and pages, batches."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection, RowMapping, text

from harvest.jobs import Job
from harvest.models import JobStatus
from harvest.search import Search
from harvest.store.quarantine import _OUT_OF_RANGE, READABLE_FROM, READABLE_TO, quarantine

# --- reading and cancelling -----------------------------------------------------------------

_TIMES = ("run_at", "created_at", "dispatched_at", "started_at", "finished_at", "lease_expires_at")
_JSON = ("payload", "result")


def _readable_columns() -> str:
    """The job columns, each read so that no stored value can fail to load: a time outside
    Python's range comes back NULL (and named in ``unreadable``, with what is stored), JSON as
    text (decoded by :func:`_job`)."""
    columns = []
    for name in Job.__dataclass_fields__:
        if name in _TIMES:
            columns.append(
                f"CASE WHEN {name} BETWEEN {READABLE_FROM} AND {READABLE_TO} THEN {name} END"
                f" AS {name}"
            )
        elif name in _JSON:
            columns.append(f"CAST({name} AS text) AS {name}")
        elif name != "unreadable":
            columns.append(name)
    bad = " || ".join(
        f"CASE WHEN {name} BETWEEN {READABLE_FROM} AND {READABLE_TO} OR {name} IS NULL"
        f" THEN '' ELSE '{name} ' || CAST({name} AS text) || '; ' END"
        for name in _TIMES
    )
    return ", ".join([*columns, f"{bad} AS unreadable"])


_JOB_COLUMNS = _readable_columns()


def _job(row: Mapping[Any, Any]) -> Job:
    """A job from a row read with :data:`_JOB_COLUMNS`; values Python cannot hold are None,
    and ``Job.unreadable`` says which and why."""
    problems = [f"{p} {_OUT_OF_RANGE}" for p in str(row["unreadable"]).split("; ") if p]
    values = dict(row)
    for name in _JSON:
        raw = values[name]
        try:
            values[name] = json.loads(raw) if raw is not None else None
        except (ValueError, RecursionError) as exc:
            values[name] = None
            problems.append(f"{name} cannot be read as JSON here ({str(exc)[:80]})")
    values["unreadable"] = tuple(problems)
    return Job.from_row(values)


def _jobs(conn: Connection, rows: Iterable[RowMapping]) -> list[Job]:
    """Jobs read tolerantly; an unfinished one holding a value that cannot be read is
    quarantined (failed, with the reason) on ``conn``: commit it to keep that."""
    jobs = [_job(r) for r in rows]
    bad = {j.id: "; ".join(j.unreadable) for j in jobs if j.unreadable and not j.terminal}
    if not bad:
        return jobs
    done = {q.id: q for q in quarantine(conn, bad)}
    return [
        replace(j, status=JobStatus.FAILED, last_error=done[j.id].reason) if j.id in done else j
        for j in jobs
    ]


def get(conn: Connection, job_id: int) -> Job | None:
    rows = conn.execute(
        text(f"SELECT {_JOB_COLUMNS} FROM harvest_jobs_all WHERE id = :id"), {"id": job_id}
    ).mappings()
    found = _jobs(conn, rows)
    return found[0] if found else None


def status_of(conn: Connection, job_id: int) -> JobStatus | None:
    value = conn.execute(
        text("SELECT status FROM harvest_jobs_all WHERE id = :id"), {"id": job_id}
    ).scalar_one_or_none()
    return JobStatus(value) if value is not None else None


def list_jobs(
    conn: Connection,
    *,
    status: str | None = None,
    name: str | None = None,
    search: Search | None = None,
    limit: int = 50,
) -> list[Job]:
    """The newest ``limit`` jobs, of one status and name if given, matching ``search``
    (:func:`list_jobs_page`'s first page)."""
    return list_jobs_page(conn, status=status, name=name, search=search, limit=limit)


# --- what the dashboard reads and deletes ----------------------------------------------------


# The job lists an operator asks for (Sidekiq's and Oban Web's): each a condition on a row.
JOB_STATES = {
    "ready": "status = 'pending' AND run_at <= now()",  # due: dispatch takes it next
    "scheduled": "status = 'pending' AND run_at > now() AND attempts = 0",  # not due yet
    "retrying": "status = 'pending' AND run_at > now() AND attempts > 0",  # waits its backoff
    "running": "status IN ('dispatched', 'running')",
    "dead": "status = 'failed'",
}


def list_jobs_page(
    conn: Connection,
    *,
    status: str | None = None,
    name: str | None = None,
    queue: str | None = None,
    batch_id: int | None = None,
    state: str | None = None,
    search: Search | None = None,
    before: int | None = None,
    after: int | None = None,
    limit: int = 50,
) -> list[Job]:
    """Jobs matching the filters, keyset-paginated by id: newest first below ``before`` (or
    from the newest), or, with ``after``, the oldest ``limit`` above ``after`` (ascending: the
    caller reverses them). ``state``: one of :data:`JOB_STATES` (what a person asks for).
    ``search``: see :mod:`harvest.search` (bound parameters only)."""
    clauses: list[str] = [JOB_STATES[state]] if state is not None else []
    params: dict[str, Any] = {"limit": limit}
    if search is not None:
        clause, value = _searched(search)
        clauses.append(clause)
        params["search"] = value
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
    sql = f"SELECT {_JOB_COLUMNS} FROM harvest_jobs_all {where} ORDER BY id {order} LIMIT :limit"
    return _jobs(conn, conn.execute(text(sql), params).mappings())


def _searched(search: Search) -> tuple[str, Any]:
    """The condition of a search, on the bound parameter ``:search``. A payload path is
    containment, which the GIN index ``harvest_jobs_payload_idx`` (jsonb_path_ops) serves."""
    if search.job_id is not None:
        return "id = :search", search.job_id
    if search.name is not None:
        return "name = :search", search.name
    if search.payload is not None:
        return "payload @> CAST(:search AS jsonb)", search.payload
    return "name ILIKE :search ESCAPE '\\'", search.like


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
