"""Pausing and resuming queues, and what each queue holds (the dashboard's Queues page, the
``harvest queues`` commands, :meth:`Harvest.pause_queue <harvest.app.Harvest.pause_queue>`).

A paused queue keeps taking jobs (enqueue is not refused), but dispatch claims none of them
until it is resumed: the paused set is a table in Postgres (migration 0009) that the claim
reads in the same statement that locks the rows, so the pause holds for every dispatcher and
across restarts. Jobs dispatched before the pause committed (in the broker, or running) still
run; a claim that began before it may still take jobs.

A queue is known when a job registered on this app uses it, when a job is stored in it (any
status), or when it is paused; pausing or resuming any other name raises
:class:`~harvest.errors.QueueNotFound`, and a malformed name
:class:`~harvest.errors.InvalidOption` (the check of ``queue=`` on a job).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from harvest import store, validation
from harvest.db import translate_errors
from harvest.errors import QueueNotFound

if TYPE_CHECKING:
    from harvest.app import Harvest


@dataclass(frozen=True, slots=True)
class Queue:
    name: str
    pending: int  # jobs waiting (due or not)
    ready: int  # of which due now: what dispatch would take next, unless paused
    running: int  # dispatched or running
    paused_at: datetime | None  # None: not paused

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


@dataclass(frozen=True, slots=True)
class QueueChange:
    queue: Queue
    changed: bool  # False: it already was paused (or running)


def _registered(app: Harvest) -> set[str]:
    return {spec.queue for spec in app.jobs.values()}


def list_all(app: Harvest) -> list[Queue]:
    """Every known queue, by name: its pending, ready and running jobs, and its pause."""
    with translate_errors(), app.engine.connect() as conn:
        figures = store.queue_figures(conn)
        paused = store.paused_queues(conn)
        stored = {q for q, _, _ in store.depth(conn)}
    names = _registered(app) | stored | set(figures) | set(paused)
    return [
        Queue(name, *figures.get(name, (0, 0, 0)), paused_at=paused.get(name))
        for name in sorted(names)
    ]


def get(app: Harvest, name: str) -> Queue:
    """One queue (raises QueueNotFound)."""
    queue = validation.check_queue(name)
    found = {q.name: q for q in list_all(app)}
    if queue not in found:
        raise QueueNotFound(queue, list(found))
    return found[queue]


def pause(app: Harvest, name: str) -> QueueChange:
    """Stop dispatching ``name``'s jobs until :func:`resume` (idempotent)."""
    queue = validation.check_queue(name)
    with translate_errors(), app.engine.begin() as conn:
        done = store.pause_queue(conn, queue, registered=queue in _registered(app))
    if not done.known:
        raise QueueNotFound(queue, sorted(_registered(app)))
    return QueueChange(get(app, queue), done.changed)


def resume(app: Harvest, name: str) -> QueueChange:
    """Dispatch ``name``'s jobs again (idempotent); dispatch is nudged to take them now."""
    queue = validation.check_queue(name)
    with translate_errors(), app.engine.begin() as conn:
        done = store.resume_queue(conn, queue, registered=queue in _registered(app))
    if not done.known:
        raise QueueNotFound(queue, sorted(_registered(app)))
    if done.changed:
        app.nudge()
    return QueueChange(get(app, queue), done.changed)
