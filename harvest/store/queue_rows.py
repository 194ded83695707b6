"""Paused queues (``harvest_queue_pauses``, migration 0009) and the figures of each queue.

Pausing and resuming are each one statement that checks and acts together: the queue must be
known (a job registered on it, a job stored in it, or paused already), and the answer says
whether this call changed anything. The claim (:mod:`harvest.store.claim`) reads the paused
set in its own statement."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text

_KNOWN = "CAST(:registered AS boolean) OR EXISTS (SELECT 1 FROM harvest_jobs WHERE queue = :queue)"

_PAUSE = text(
    f"""
    WITH known AS (
        SELECT {_KNOWN}
            OR EXISTS (SELECT 1 FROM harvest_queue_pauses WHERE queue = :queue) AS ok
    ), added AS (
        INSERT INTO harvest_queue_pauses (queue) SELECT :queue FROM known WHERE ok
        ON CONFLICT (queue) DO NOTHING
        RETURNING queue
    )
    SELECT (SELECT ok FROM known) AS known, EXISTS (SELECT 1 FROM added) AS changed
    """
)

_RESUME = text(
    f"""
    WITH removed AS (DELETE FROM harvest_queue_pauses WHERE queue = :queue RETURNING queue)
    SELECT EXISTS (SELECT 1 FROM removed) OR {_KNOWN} AS known,
           EXISTS (SELECT 1 FROM removed) AS changed
    """
)


@dataclass(frozen=True, slots=True)
class Toggled:
    known: bool  # the queue exists (registered, holding jobs, or paused)
    changed: bool  # this call paused (or resumed) it; False: it already was


def pause_queue(conn: Connection, queue: str, *, registered: bool) -> Toggled:
    """Pause ``queue`` if it is known (``registered``: a job of this app uses it)."""
    row = conn.execute(_PAUSE, {"queue": queue, "registered": registered}).one()
    return Toggled(bool(row.known), bool(row.changed))


def resume_queue(conn: Connection, queue: str, *, registered: bool) -> Toggled:
    """Resume ``queue`` if it is paused."""
    row = conn.execute(_RESUME, {"queue": queue, "registered": registered}).one()
    return Toggled(bool(row.known), bool(row.changed))


def paused_queues(conn: Connection) -> dict[str, datetime]:
    """Every paused queue and when it was paused."""
    rows = conn.execute(text("SELECT queue, paused_at FROM harvest_queue_pauses"))
    return {r.queue: r.paused_at for r in rows}


_QUEUE_FIGURES = text(
    """
    SELECT queue,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'pending' AND run_at <= now()) AS ready,
           count(*) FILTER (WHERE status IN ('dispatched', 'running')) AS running
    FROM harvest_jobs WHERE status IN ('pending', 'dispatched', 'running')
    GROUP BY queue
    """
)


def queue_figures(conn: Connection) -> dict[str, tuple[int, int, int]]:
    """(pending, of which due now, dispatched or running) of each queue holding such jobs."""
    rows = conn.execute(_QUEUE_FIGURES)
    return {r.queue: (int(r.pending), int(r.ready), int(r.running)) for r in rows}
