"""What the dashboard and its API read and do: thin calls into the library (store, stats,
keystore, the key pool, schedules, batches and the Harvest object).

The web layer has no SQL of its own: every statement it needs lives in harvest/store/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import Connection

from harvest import history, keystore, processes, stats, store
from harvest.app import Harvest
from harvest.batches import Batch
from harvest.coordination.key_pool import KeyPool
from harvest.db import translate_errors
from harvest.errors import (
    HarvestError,
    JobNotFound,
    KeyNotFound,
    ScheduleNotFound,
    ServiceUnavailable,
)
from harvest.jobs import Job
from harvest.models import JobStatus
from harvest.redact import redact_text
from harvest.schedules import Schedule
from harvest.search import Search

MAX_PAGE = 500
DELETE_BATCH = 1000


class Conflict(HarvestError):
    """The action does not apply to the thing in its current state (HTTP 409)."""


class NotFound(HarvestError, LookupError):
    """No such thing (HTTP 404)."""


# --- overview -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Minute:
    """Jobs that ended within one minute."""

    at: datetime
    succeeded: int
    failed: int
    cancelled: int
    wait_p: tuple[float, float, float] | None  # enqueue (due) to start, seconds
    run_p: tuple[float, float, float] | None  # start to finish of successful attempts

    @property
    def ended(self) -> int:
        return self.succeeded + self.failed + self.cancelled


def _triple(value: Any) -> tuple[float, float, float] | None:
    return (float(value[0]), float(value[1]), float(value[2])) if value else None


def minutes(app: Harvest, *, count: int) -> list[Minute]:
    """The last ``count`` minutes, oldest first, with empty minutes filled in."""
    with translate_errors(), app.engine.connect() as conn:
        current, rows = store.minute_rows(conn, minutes=count)
    by_minute = {r.minute: r for r in rows}
    series = []
    for i in range(count - 1, -1, -1):
        at = current - timedelta(minutes=i)
        r = by_minute.get(at)
        if r is None:
            series.append(Minute(at, 0, 0, 0, None, None))
        else:
            series.append(
                Minute(
                    at,
                    int(r.succeeded),
                    int(r.failed),
                    int(r.cancelled),
                    _triple(r.wait_p),
                    _triple(r.run_p),
                )
            )
    return series


@dataclass(frozen=True, slots=True)
class Overview:
    figures: stats.Stats
    minutes: list[Minute]
    pools: list[PoolView] | str  # a note when Redis does not answer

    @property
    def by_status(self) -> dict[str, int]:
        totals: dict[str, int] = dict.fromkeys((s.value for s in JobStatus), 0)
        for _, status, n in self.figures.depth:
            totals[status] = totals.get(status, 0) + n
        return totals

    @property
    def queues(self) -> list[str]:
        return sorted({q for q, _, _ in self.figures.depth})

    def depth(self, queue: str, status: str) -> int:
        return sum(n for q, s, n in self.figures.depth if q == queue and s == status)


def overview(app: Harvest, *, count: int = 30) -> Overview:
    """Depth by queue and status, the last minute's outcomes and latencies, counters, the
    last ``count`` minutes, and key pool utilisation."""
    return Overview(stats.collect(app.engine), minutes(app, count=count), key_pools(app))


# --- jobs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobFilter:
    status: str | None = None
    name: str | None = None
    queue: str | None = None
    batch_id: int | None = None
    state: str | None = None  # ready, scheduled, retrying, running, dead (store.JOB_STATES)
    search: Search | None = None  # harvest.search: id, name, or payload path


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[Job]
    older: int | None  # pass as ``before`` for the next (older) page
    newer: int | None  # pass as ``after`` for the previous (newer) page


def job_page(
    app: Harvest,
    where: JobFilter,
    *,
    before: int | None = None,
    after: int | None = None,
    per_page: int = 50,
) -> JobPage:
    """One page of jobs, newest first."""
    per_page = max(1, min(per_page, MAX_PAGE))
    with translate_errors(), app.engine.begin() as conn:  # begin: a quarantine is kept
        rows = store.list_jobs_page(
            conn,
            status=where.status,
            name=where.name,
            queue=where.queue,
            batch_id=where.batch_id,
            state=where.state,
            search=where.search,
            before=before if after is None else None,
            after=after,
            limit=per_page + 1,
        )
    more = len(rows) > per_page
    rows = rows[:per_page]
    if after is not None:
        rows.reverse()
        newer = rows[0].id if more and rows else None
        older = rows[-1].id if rows else None
    else:
        older = rows[-1].id if more else None
        newer = rows[0].id if before is not None and rows else None
    return JobPage(rows, older, newer)


def job(app: Harvest, job_id: int) -> Job:
    return app.get(job_id)


def live_processes(app: Harvest) -> list[processes.Process]:
    with translate_errors():
        return processes.processes(app.engine, app.redis)


def job_attempts(app: Harvest, job_id: int) -> list[history.Attempt]:
    with translate_errors(), app.engine.connect() as conn:
        return history.attempts(conn, job_id)


def retry_job(app: Harvest, job_id: int) -> None:
    """A dead job back to pending (one more attempt allowed)."""
    try:
        app.retry(job_id)
    except (JobNotFound, ServiceUnavailable):
        raise
    except HarvestError as exc:  # not failed (InvalidOption or HarvestError, by version)
        raise Conflict(str(exc).removeprefix("invalid job_id: ")) from None


def cancel_job(app: Harvest, job_id: int) -> JobStatus:
    return app.cancel(job_id)


def delete_dead_job(app: Harvest, job_id: int) -> None:
    with translate_errors(), app.engine.begin() as conn:
        if store.delete_failed(conn, job_id):
            return
    current = app.get(job_id)  # raises JobNotFound
    raise Conflict(f"job {job_id} is {current.status}, not failed (only dead jobs are deleted)")


def retry_dead(app: Harvest, *, name: str | None, at_most: int | None = None) -> int:
    """Dead jobs (of one exact name, or all) back to pending, oldest first, in batches; at
    most ``at_most`` of them (all when None). Returns how many."""
    total = _bounded(app, lambda conn, n: len(store.retry_failed_many(conn, name=name, limit=n)),
                     at_most)  # fmt: skip
    if total:
        app.nudge()
    return total


def delete_dead(app: Harvest, *, name: str | None, at_most: int | None = None) -> int:
    """Delete dead jobs (of one exact name, or all), oldest first, in batches; at most
    ``at_most`` of them (all when None). Returns how many."""
    return _bounded(
        app, lambda conn, n: store.delete_failed_many(conn, name=name, limit=n), at_most
    )


def _bounded(app: Harvest, act: Callable[[Connection, int], int], at_most: int | None) -> int:
    """Run ``act(conn, limit)`` (one statement touching at most ``limit`` rows) in batches of
    DELETE_BATCH, each its own transaction, until it touches fewer than asked or ``at_most``
    rows are done. The bound is in every statement: no batch can overshoot it."""
    total = 0
    while at_most is None or total < at_most:
        limit = DELETE_BATCH if at_most is None else min(DELETE_BATCH, at_most - total)
        with translate_errors(), app.engine.begin() as conn:
            n = act(conn, limit)
        total += n
        if n < limit:
            break
    return total


def queues(app: Harvest) -> list[str]:
    """Every queue that holds jobs."""
    with translate_errors(), app.engine.connect() as conn:
        return sorted({q for q, _, _ in store.depth(conn)})


def names(app: Harvest) -> dict[str, dict[str, int]]:
    """Jobs by name, then status (for filters and the dead jobs page)."""
    by_name: dict[str, dict[str, int]] = {}
    for name, status, n in stats.jobs_by_name(app.engine):
        by_name.setdefault(name, {})[status] = n
    return dict(sorted(by_name.items()))


# --- keys -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyView:
    """A key as the dashboard shows it: its masked hint, never its secret."""

    info: keystore.KeyInfo
    use: stats.KeyUse | None  # None when the pool's live state is not known

    @property
    def status(self) -> str:
        return self.use.status if self.use is not None else self.info.status

    @property
    def leases(self) -> int | None:
        live = self.use.live if self.use is not None else None
        return live.live_leases if live is not None else None

    @property
    def utilisation(self) -> float | None:
        leases = self.leases
        return leases / self.info.max_concurrency if leases is not None else None

    @property
    def learned(self) -> str | None:
        """Its limits as learned from the service (see KeyState.learned_text)."""
        live = self.use.live if self.use is not None else None
        return live.learned_text if live is not None else None

    @property
    def cooldown_until(self) -> datetime | None:
        until = self.info.cooldown_until
        live = self.use.live if self.use is not None else None
        if live is not None and live.cooldown_until is not None:
            live_until = datetime.fromtimestamp(live.cooldown_until, UTC)
            until = max(until, live_until) if until is not None else live_until
        return until


@dataclass(frozen=True, slots=True)
class PoolView:
    use: stats.PoolUse
    keys: list[KeyView]


def key_pools(app: Harvest) -> list[PoolView] | str:
    """Every pool with each key's live state; a note instead when Redis does not answer."""
    with translate_errors(), app.engine.connect() as conn:
        infos = {k.id: k for k in keystore.list_keys(conn)}
    try:
        pools = stats.key_pools(app.engine, app.redis)
    except ServiceUnavailable as exc:
        if exc.service != "Redis":
            raise
        return str(exc)
    views = []
    for pool in pools:
        keys = [KeyView(infos[k.key_id], k) for k in pool.keys if k.key_id in infos]
        views.append(PoolView(pool, keys))
    return views


def set_key_enabled(app: Harvest, key_id: int, *, enabled: bool) -> keystore.KeyInfo:
    """Enable or disable a key in Postgres, then bring the live pool in Redis in step (a
    disabled key is never leased again; leases held now run out)."""
    try:
        with translate_errors(), app.engine.begin() as conn:
            info = keystore.set_status(conn, key_id, "active" if enabled else "disabled")
    except KeyNotFound:
        raise NotFound(f"no API key with id {key_id}") from None
    try:
        keystore.sync_pool(app.engine, app.redis, info.pool)
        if enabled:  # an operator's enable: leased again now, a running cooldown ended
            KeyPool(app.redis, info.pool).end_cooldown(info.id)
    except RedisError as exc:
        lines = redact_text(str(exc)).splitlines()
        raise ServiceUnavailable(
            "Redis",
            f"{lines[0] if lines else type(exc).__name__}; the change is saved in Postgres: "
            f"run `harvest keys sync {info.pool}` once Redis answers",
        ) from None
    return info


# --- schedules and batches ------------------------------------------------------------------


def schedules(app: Harvest) -> list[Schedule]:
    return app.list_schedules()


def schedule_by_id(app: Harvest, schedule_id: int) -> Schedule:
    for found in app.list_schedules():
        if found.id == schedule_id:
            return found
    raise ScheduleNotFound(str(schedule_id))


def set_schedule_enabled(app: Harvest, schedule_id: int, *, enabled: bool) -> Schedule:
    name = schedule_by_id(app, schedule_id).name
    return app.resume_schedule(name) if enabled else app.pause_schedule(name)


def batches(app: Harvest, *, before: int | None = None, per_page: int = 50) -> list[Batch]:
    with translate_errors(), app.engine.connect() as conn:
        rows = store.list_batches(conn, before=before, limit=max(1, min(per_page, MAX_PAGE)))
        return [Batch.from_row(r) for r in rows]


def batch(app: Harvest, batch_id: int) -> Batch:
    return app.batch(batch_id)
