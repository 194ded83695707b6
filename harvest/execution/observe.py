"""What an execution worker tells the world about each attempt, as it happens.

Observers (job-level log lines, Celery task events for Flower) subclass
:class:`AttemptObserver` and override what they need. They are called synchronously from the
thread or event loop that runs the job, so each call must be quick and must not block on the
network; an observer that raises is logged once and ignored, never the job's problem.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harvest.execution.outcome import Outcome
from harvest.jobs import Started

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """A job of a message this worker holds (dispatch lease extended), before its gate."""

    job_id: int
    name: str
    attempt: int  # the attempt it will be if it starts (attempts so far + 1)
    worker: str  # hostname:pid


@dataclass(frozen=True, slots=True)
class Deferred:
    """A held job that went back to pending without starting (no key or permit in time, or
    the worker was shutting down); no attempt was counted."""

    job_id: int
    name: str
    attempt: int
    delay: float
    reason: str
    worker: str


@dataclass(frozen=True, slots=True)
class AttemptStarted:
    job: Started
    worker: str
    at: float  # wall clock, seconds since the epoch


@dataclass(frozen=True, slots=True)
class AttemptEnded:
    job: Started
    outcome: Outcome
    seconds: float  # the handler's run time
    worker: str
    recorded: bool  # False: the fenced write was refused (another attempt owns the job)
    at: float  # wall clock, seconds since the epoch


class AttemptObserver:
    """Hooks for each step of an attempt; every one does nothing unless overridden."""

    def received(self, event: Received) -> None:
        """A job of a message was held by this worker."""

    def deferred(self, event: Deferred) -> None:
        """A held job went back to pending without an attempt."""

    def started(self, event: AttemptStarted) -> None:
        """An attempt started (the handler is about to run)."""

    def ended(self, event: AttemptEnded) -> None:
        """An attempt ended (its outcome written, or refused by the fence)."""


class Observers(AttemptObserver):
    """Several observers called in order; one that raises is logged and skipped."""

    def __init__(self, observers: Sequence[AttemptObserver] = ()) -> None:
        self.observers = list(observers)
        self._warned: set[tuple[type, str]] = set()

    def add(self, observer: AttemptObserver) -> None:
        self.observers.append(observer)

    def _each(self, hook: str, event: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, hook)(event)
            except Exception as exc:
                key = (type(observer), hook)
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning(
                        "observer %s.%s failed (%s); ignored from now on for this error",
                        type(observer).__name__,
                        hook,
                        type(exc).__name__,
                    )

    def received(self, event: Received) -> None:
        self._each("received", event)

    def deferred(self, event: Deferred) -> None:
        self._each("deferred", event)

    def started(self, event: AttemptStarted) -> None:
        self._each("started", event)

    def ended(self, event: AttemptEnded) -> None:
        self._each("ended", event)


def notify(
    observer: AttemptObserver, event: Received | Deferred | AttemptStarted | AttemptEnded
) -> None:
    """Call the hook of ``observer`` that ``event`` is for."""
    if isinstance(event, AttemptEnded):
        observer.ended(event)
    elif isinstance(event, AttemptStarted):
        observer.started(event)
    elif isinstance(event, Deferred):
        observer.deferred(event)
    else:
        observer.received(event)
