"""The operator's controls on the :class:`~harvest.app.Harvest` facade: recurring schedules
(:mod:`harvest.schedules`) and queue pauses (:mod:`harvest.queues`). :class:`Controls` is a part
of the facade: its methods are the facade's, each a thin call into its own module."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Unpack, cast

from harvest import queues, schedules

if TYPE_CHECKING:
    from harvest.app import Harvest
    from harvest.queues import Queue, QueueChange
    from harvest.schedules import Schedule, ScheduleChanges


class Controls:
    """Schedules and queue pauses: get or create, change, pause, resume, delete, list."""

    def _app(self) -> Harvest:
        return cast("Harvest", self)  # a part of the facade: self is always the Harvest

    # --- recurring schedules ------------------------------------------------------------------

    def schedule(
        self,
        name: str,
        job: str,
        *,
        cron: str | None = None,
        every: float | timedelta | None = None,
        payload: Mapping[str, Any] | None = None,
        timezone: str = "UTC",
        misfire: str = "run_once",
        catch_up: int = 1,
        priority: int = 0,
        enabled: bool = True,
        start_at: datetime | None = None,
    ) -> Schedule:
        """Get or create the recurring schedule ``name``: ``job`` with ``payload`` at every fire
        time. An existing schedule of that name is returned unchanged (``created`` False): use
        :meth:`update_schedule` to change it.

        :param cron: a cron expression (5 fields, or 6 with seconds last; ``@hourly`` ...),
            evaluated in ``timezone``.
        :param every: instead of ``cron``: seconds (or a timedelta) between fire times, >= 1 s.
        :param payload: the job's keyword arguments, checked against its handler now.
        :param timezone: an IANA name (``Europe/Paris``); cron times follow its DST changes.
        :param misfire: ``skip`` | ``run_once`` | ``catch_up``: what a tick does with fire
            times later than ``HARVEST_SCHEDULE_GRACE`` (see :mod:`harvest.schedules`).
        :param catch_up: with ``misfire="catch_up"``, run at most this many due fire times.
        :param priority: the jobs' priority.
        :param enabled: False creates it paused.
        :param start_at: the first fire time (interval), or the earliest (cron).
        :raises EnqueueError: (UnknownJob, InvalidPayload, InvalidSchedule naming the field)
            when refused; nothing is stored then.
        """
        return schedules.create(
            self._app(), name, job, cron=cron, every=every, payload=payload, timezone=timezone,
            misfire=misfire, catch_up=catch_up, priority=priority, enabled=enabled,
            start_at=start_at,
        )  # fmt: skip

    def update_schedule(self, name: str, **changes: Unpack[ScheduleChanges]) -> Schedule:
        """Change a schedule (None: unchanged): keyword arguments ``job``, ``cron``, ``every``,
        ``payload``, ``timezone``, ``misfire``, ``catch_up``, ``priority`` and ``start_at``, as
        for :meth:`schedule` (see :class:`~harvest.schedules.ScheduleChanges`). A new ``cron``,
        ``every``, ``timezone`` or ``start_at`` re-times it from now. Raises ScheduleNotFound."""
        return schedules.update(self._app(), name, **changes)

    def pause_schedule(self, name: str) -> Schedule:
        """Stop firing ``name`` until resumed."""
        return schedules.set_enabled(self._app(), name, False)

    def resume_schedule(self, name: str) -> Schedule:
        """Fire ``name`` again, from its next fire time after now (the pause is not caught up)."""
        return schedules.set_enabled(self._app(), name, True)

    def delete_schedule(self, name: str) -> None:
        """Delete ``name`` and its fire records (jobs already enqueued stay)."""
        schedules.delete(self._app(), name)

    def get_schedule(self, name: str) -> Schedule:
        return schedules.get(self._app(), name)

    def list_schedules(self) -> list[Schedule]:
        return schedules.list_all(self._app())

    # --- queues -------------------------------------------------------------------------------

    def pause_queue(self, name: str) -> QueueChange:
        """Dispatch claims none of queue ``name``'s jobs until :meth:`resume_queue`; enqueue
        still stores them. Kept in Postgres (survives restarts); jobs already dispatched run.
        Idempotent (``changed`` False when it was paused already).

        :raises QueueNotFound: no registered job uses it, no job is stored in it.
        :raises InvalidOption: not a usable queue name."""
        return queues.pause(self._app(), name)

    def resume_queue(self, name: str) -> QueueChange:
        """Dispatch queue ``name``'s jobs again (idempotent); raises as :meth:`pause_queue`."""
        return queues.resume(self._app(), name)

    def list_queues(self) -> list[Queue]:
        """Every known queue: pending, ready and running jobs, and whether it is paused."""
        return queues.list_all(self._app())
