"""Every job attempt as a Celery task in the event stream, so Flower, ``celery events`` and
anything else that reads Celery's events shows harvest's jobs as a Celery user expects.

One attempt is one task: its id is stable (derived from the job id and the attempt), its name
is the job's name, its args are the payload (redacted and truncated, as Celery's ``argsrepr``).
When the attempt starts the worker sends ``task-received`` and ``task-started``; when it ends,
``task-succeeded`` (with the result and run time), ``task-retried`` (a retry is scheduled: the
next attempt is another task), ``task-failed`` (the job is dead, with its exception) or
``task-revoked`` (cancelled). A held job that goes back to pending without starting (no key in
time) sends nothing: no attempt was made.

Events are best effort, as Celery's own are: sent from one thread per process over its own
broker connection, dropped (and counted in the log) when the broker is away or the backlog is
over :data:`BACKLOG`; a job never waits for them.

They are sent while the worker sends task events, as Celery decides it (``HARVEST_TASK_EVENTS``
unset): started with ``-E``, or turned on by ``enable_events`` (Flower sends it when it starts
and every 5 s; ``celery control enable_events``), off again after ``disable_events``. Celery
keeps that state in the worker's main process, which the prefork children that run the jobs
cannot see: :class:`FollowTaskEvents` copies it every :data:`FOLLOW_EVERY` seconds into
:data:`SWITCH`, a byte of memory shared with them. With nobody watching, no job pays for
events (in the huge goodput case they were a twelfth of an execution process's CPU).
``HARVEST_TASK_EVENTS=true`` sends them always, ``false`` never.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
import uuid
from typing import Any

from celery import Celery, bootsteps
from celery.utils.time import utcoffset

from harvest.execution.observe import AttemptEnded, AttemptObserver, AttemptStarted
from harvest.models import JobStatus
from harvest.redact import redact_text

log = logging.getLogger(__name__)

BACKLOG = 10_000  # events waiting to be sent; beyond it new ones are dropped
BATCH = 100  # events one message carries at most
FLUSH_EVERY = 0.25  # seconds an event may wait for others to share its message
ARGS_CHARS = 1024  # Celery's argsrepr is cut at the same length
RESULT_CHARS = 1024
NAMESPACE = uuid.UUID("6a1d3f0e-4b7e-4c1a-9a55-8f3d6c2b7e10")
FOLLOW_EVERY = 1.0  # seconds between two copies of the worker's task-event state to SWITCH


class EventSwitch:
    """Whether the worker sends task events: one byte of anonymous shared memory, made when
    this module is imported (in the worker's main process, before its pool forks), so that
    every child forked after sees what the main process sets."""

    def __init__(self) -> None:
        self._byte = mmap.mmap(-1, 1)  # MAP_SHARED: a write is seen across fork

    @property
    def on(self) -> bool:
        return self._byte[0] == 1

    def set(self, on: bool) -> bool:
        """Set it; True when that changed it."""
        value = 1 if on else 0
        if self._byte[0] == value:
            return False
        self._byte[0] = value
        return True


SWITCH = EventSwitch()


def sends_task_events(dispatcher: Any) -> bool:
    """Whether Celery's event dispatcher sends a task event: it is enabled, and the ``task``
    group is among its groups (none named: all)."""
    return (
        dispatcher is not None
        and bool(dispatcher.enabled)
        and (not dispatcher.groups or "task" in dispatcher.groups)
    )


class FollowTaskEvents(bootsteps.StartStopStep):  # type: ignore[misc]
    """A step of the worker's consumer: at its start and every :data:`FOLLOW_EVERY` seconds,
    copy whether the worker sends task events (``-E``, ``enable_events``, ``disable_events``)
    into :data:`SWITCH`, and log each change."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.timer: Any = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        self.follow(c)
        if self.timer is None:
            self.timer = c.timer.call_repeatedly(FOLLOW_EVERY, self.follow, (c,))

    def stop(self, c: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)

    def follow(self, c: Any) -> None:
        dispatcher = c.event_dispatcher
        if dispatcher is None:  # reconnecting: the state stays as it was
            return
        on = sends_task_events(dispatcher)
        if SWITCH.set(on):
            state = "on" if on else "off"
            log.info("job events %s, as this worker's task events (-E, enable_events)", state)


def attempt_task_id(job_id: int, attempt: int) -> str:
    """The task id of one attempt of a job: the same in every event and on every worker."""
    return str(uuid.uuid5(NAMESPACE, f"{job_id}:{attempt}"))


def _cut(text: str, limit: int) -> str:
    text = redact_text(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def started_events(event: AttemptStarted) -> list[tuple[str, dict[str, Any]]]:
    job = event.job
    task_id = attempt_task_id(job.id, job.attempt)
    received = {
        "uuid": task_id,
        "name": job.name,
        "args": _cut(repr(job.payload), ARGS_CHARS),
        "kwargs": "{}",
        "retries": job.attempt - 1,
        "eta": None,
        "expires": None,
        "root_id": task_id,
        "parent_id": None,
        "job_id": job.id,
    }
    return [("task-received", received), ("task-started", {"uuid": task_id})]


def ended_events(event: AttemptEnded) -> list[tuple[str, dict[str, Any]]]:
    """What Celery would send as the task ends. A refused fenced write (another attempt owns
    the job now) sends nothing: this attempt's outcome did not count."""
    if not event.recorded:
        return []
    job, outcome = event.job, event.outcome
    task_id = attempt_task_id(job.id, job.attempt)
    error = f"{outcome.error_type or 'Error'}({outcome.error or ''!r})"
    if outcome.status is JobStatus.SUCCEEDED:
        result = _cut(outcome.result_json or "null", RESULT_CHARS)
        return [("task-succeeded", {"uuid": task_id, "result": result, "runtime": event.seconds})]
    if outcome.status is JobStatus.CANCELLED:
        return [("task-revoked", {"uuid": task_id, "terminated": True, "signum": None})]
    fields = {"uuid": task_id, "exception": _cut(error, RESULT_CHARS)}
    fields["traceback"] = _cut(outcome.traceback or "", 10 * RESULT_CHARS)
    if outcome.retrying:
        return [("task-retried", fields)]
    return [("task-failed", fields)]


class TaskEvents(AttemptObserver):
    """Sends each attempt's task events (an attempt observer; see
    :mod:`harvest.execution.observe`) under the worker's node name (``execution@host``),
    while ``switch`` is on (None: always)."""

    def __init__(self, celery: Celery, hostname: str, switch: EventSwitch | None = None) -> None:
        self.celery, self.hostname, self.switch = celery, hostname, switch
        self._queue: queue.SimpleQueue[tuple[str, dict[str, Any], float]] = queue.SimpleQueue()
        self._pid = 0
        self._dropped = 0
        self._lock = threading.Lock()

    def started(self, event: AttemptStarted) -> None:
        if self.switch is None or self.switch.on:
            self._put(started_events(event), event.at)

    def ended(self, event: AttemptEnded) -> None:
        if self.switch is None or self.switch.on:
            self._put(ended_events(event), event.at)

    def _put(self, events: list[tuple[str, dict[str, Any]]], at: float) -> None:
        if self._pid != os.getpid():  # first use in this process (the thread starts after fork)
            with self._lock:
                if self._pid != os.getpid():
                    self._queue = queue.SimpleQueue()
                    threading.Thread(
                        target=self._send_forever, name="harvest-events", daemon=True
                    ).start()
                    self._pid = os.getpid()
        if self._queue.qsize() + len(events) > BACKLOG:
            self._dropped += len(events)
            return
        for kind, fields in events:
            self._queue.put((kind, fields, at))

    def _send_forever(self) -> None:
        pause = 0.5
        while True:
            try:
                with self.celery.connection_for_write() as conn:
                    dispatcher = self.celery.events.Dispatcher(
                        conn, hostname=self.hostname, enabled=True, buffer_while_offline=False
                    )  # its producer, exchange and clock: see _send_batches
                    pause = 0.5
                    self._send_batches(dispatcher)
            except Exception as exc:
                log.warning("task events not sent (%s); again in %.1fs", type(exc).__name__, pause)
                time.sleep(pause)
                pause = min(pause * 2, 30.0)

    def _send_batches(self, dispatcher: Any) -> None:
        """Every :data:`FLUSH_EVERY` seconds, send what came meanwhile, in messages of up to
        :data:`BATCH`: at hundreds of jobs a second one publish carries many events instead
        of one each. The thread sleeps between rounds rather than waiting on the queue: a
        waiting thread is woken by every event put, and those wake-ups (a GIL hand-over
        each) were a tenth of an execution process's time at 400 jobs a second.

        Each event is the dict Celery's dispatcher would make (type, timestamp, hostname,
        utcoffset, pid and the Lamport clock, with the task's fields), stamped with the time
        it happened rather than the time it is sent, and the batch is published as Celery
        publishes a buffered group (a list, routing key ``task.multi``). Made here rather than
        through ``Dispatcher.send``, which builds each one through several calls: at three
        events a job that was a fifth of an async execution process's CPU."""
        while True:
            time.sleep(FLUSH_EVERY)
            common = {"hostname": self.hostname, "utcoffset": utcoffset(), "pid": os.getpid()}
            batch: list[dict[str, Any]] = []
            while True:
                try:
                    kind, fields, at = self._queue.get_nowait()
                except queue.Empty:
                    break
                fields.update(common, type=kind, timestamp=at, clock=dispatcher.clock.forward())
                batch.append(fields)
                if len(batch) >= BATCH:
                    _publish(dispatcher, batch)
                    batch = []
            if batch:
                _publish(dispatcher, batch)
            if self._dropped:
                log.warning("%d task events dropped (backlog full)", self._dropped)
                self._dropped = 0


def _publish(dispatcher: Any, events: list[dict[str, Any]]) -> None:
    """Publish ``events`` as one message, as Celery's dispatcher publishes a buffered group."""
    dispatcher.producer.publish(
        events,
        routing_key="task.multi",
        exchange=dispatcher.exchange.name,
        declare=[dispatcher.exchange],
        serializer=dispatcher.serializer,
        headers=dispatcher.headers,
        delivery_mode=dispatcher.delivery_mode,
    )
