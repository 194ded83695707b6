"""Job-level log lines: one when an attempt starts, one when it ends, on the ``harvest.jobs``
logger.

Each line carries the job's id and name, the attempt out of its maximum and the worker; the end
line adds the outcome, the handler's run time, and for a failure or a retry the error's type
and message (URL passwords and the leased key masked, one line, at most 500 characters) and
the retry delay::

    event=job.start job=12 name=fetch_page attempt=1/5 worker=host:4242
    event=job.end job=12 name=fetch_page attempt=1/5 outcome=retry duration_s=0.532 \\
        retry_in_s=1.07 error_type=RuntimeError error="upstream said 503"

``HARVEST_JOB_LOG`` chooses which: ``all`` (the default), ``ends`` (the end line only),
``problems`` (the end of an attempt that did not succeed) or ``off``.

``HARVEST_LOG_FORMAT=logfmt`` (the default) sends them through the worker's log, after
Celery's prefix, at the worker's level (``-l``): a start or success is INFO, a retry WARNING, a
failure ERROR, so a worker at Celery's default level (WARNING) writes only the problems and
``-l INFO`` every line. ``json`` writes each alone, as one JSON object with ``ts`` and ``level``, on
the process's stderr, so a log shipper can read them as they are (give the ``harvest.jobs``
logger a handler of your own to send them elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from harvest.execution.observe import AttemptEnded, AttemptObserver, AttemptStarted
from harvest.models import JobStatus
from harvest.redact import redact_text

LOGGER = "harvest.jobs"
MAX_ERROR_CHARS = 500
Format = Literal["logfmt", "json"]
Lines = Literal["all", "ends", "problems"]  # HARVEST_JOB_LOG (off: no JobLog at all)

_OUTCOMES = {
    JobStatus.SUCCEEDED: "succeeded",
    JobStatus.PENDING: "retry",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
}
_LEVELS = {"retry": logging.WARNING, "failed": logging.ERROR}


class JobLog(AttemptObserver):
    """The job-level log lines (an attempt observer; see :mod:`harvest.execution.observe`)."""

    def __init__(
        self, fmt: Format = "logfmt", logger: logging.Logger | None = None, lines: Lines = "all"
    ) -> None:
        self.fmt = fmt
        self.log = logger or logging.getLogger(LOGGER)
        self.starts = lines == "all"
        self.successes = lines in ("all", "ends")
        if fmt == "json" and logger is None:
            _own_lines(self.log)

    def started(self, event: AttemptStarted) -> None:
        if not self.starts or not self.log.isEnabledFor(logging.INFO):
            return  # (at Celery's default level, WARNING, before any field is made)
        job = event.job
        fields = {
            "event": "job.start",
            "job": job.id,
            "name": job.name,
            "attempt": f"{job.attempt}/{job.max_attempts}",
            "worker": event.worker,
        }
        self._emit(logging.INFO, fields, event.at)

    def ended(self, event: AttemptEnded) -> None:
        job, outcome = event.job, event.outcome
        name = _OUTCOMES.get(outcome.status, str(outcome.status))
        if name == "succeeded" and event.recorded and not self.successes:
            return
        level = _LEVELS.get(name, logging.INFO) if event.recorded else logging.WARNING
        if not self.log.isEnabledFor(level):
            return
        fields: dict[str, Any] = {
            "event": "job.end",
            "job": job.id,
            "name": job.name,
            "attempt": f"{job.attempt}/{job.max_attempts}",
            "outcome": name,
            "duration_s": round(event.seconds, 3),
        }
        if outcome.retrying:
            fields["retry_in_s"] = round(outcome.retry_delay, 3)
            if outcome.refund_attempt:
                fields["attempt_counted"] = False
        if outcome.error is not None and name != "succeeded":
            fields["error_type"] = outcome.error_type or "Error"
            fields["error"] = _error_text(outcome.error, outcome.error_type)
        if not event.recorded:
            fields["recorded"] = False  # another attempt owns the job: this outcome was dropped
        fields["worker"] = event.worker
        self._emit(level, fields, event.at)

    def _emit(self, level: int, fields: dict[str, Any], at: float) -> None:
        if self.fmt == "json":
            when = datetime.fromtimestamp(at or time.time(), UTC)
            stamp, name = when.isoformat(timespec="milliseconds"), logging.getLevelName(level)
            head = {"ts": stamp, "level": name.lower()}
            line = json.dumps({**head, **fields}, default=str)
        else:
            line = logfmt(fields)
        if logging.getLogRecordFactory() is not logging.LogRecord:  # someone's own records
            self.log.log(level, "%s", line)
            return
        self.log.handle(_record(self.log.name, level, line))


# What ``Logger.log`` works out again for every record, and which is the same for every job
# line of a process: where it was logged from (a walk up the stack), the file's and module's
# names, the process's name and id. At two lines a job and thousands of jobs a second, making
# each record as ``Logger.log`` does was a third of the lines' cost, and the lines a fifth of
# an async execution process's CPU. A line's record is a copy of one made the usual way in
# this process, with its own message, level, time and thread; it is handled as ``Logger.log``
# handles it (the logger's filters, then every handler up to the root). A record factory of
# your own (``logging.setLogRecordFactory``) still makes every record.
_MADE: dict[str, Any] = {}


def _record(name: str, level: int, line: str) -> logging.LogRecord:
    """The record ``Logger.log(level, "%s", line)`` makes, from :data:`_MADE`."""
    if _MADE.get("process") != os.getpid() or _MADE.get("name") != name:  # first, or forked
        caller = sys._getframe(1)
        made = logging.LogRecord(
            name, level, caller.f_code.co_filename, caller.f_lineno, "", None, None,
            func=caller.f_code.co_name,
        )  # fmt: skip
        _MADE.clear()
        _MADE.update(made.__dict__)
    record = logging.LogRecord.__new__(logging.LogRecord)
    record.__dict__.update(_MADE)
    now = time.time()
    record.msg, record.args = "%s", (line,)  # as Logger.log(level, "%s", line) has them
    record.levelno, record.levelname = level, logging.getLevelName(level)
    record.created = now
    record.msecs = int((now - int(now)) * 1000) + 0.0
    record.relativeCreated = _MADE["relativeCreated"] + (now - _MADE["created"]) * 1000
    thread = threading.current_thread()
    record.thread, record.threadName = thread.ident, thread.name
    if "taskName" in _MADE:  # Python 3.12+: the asyncio task logging, as LogRecord finds it
        record.taskName = _task_name()
    return record


def _task_name() -> str | None:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop in this thread
        return None
    return None if task is None else task.get_name()


def logfmt(fields: Mapping[str, Any]) -> str:
    """``key=value`` pairs; values with spaces, quotes or ``=`` quoted (``\\`` and ``"``
    escaped), booleans as true/false."""
    return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())


def _logfmt_value(value: Any) -> str:
    if value is True or value is False:
        return "true" if value else "false"
    text = "" if value is None else str(value)
    if text and " " not in text and "=" not in text and '"' not in text and "\\" not in text:
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _error_text(error: str, error_type: str | None) -> str:
    """The error's message on one line, without its type prefix, masked and bounded."""
    if error_type and error.startswith(f"{error_type}: "):
        error = error[len(error_type) + 2 :]
    flat = " ".join(redact_text(error).split())
    return flat if len(flat) <= MAX_ERROR_CHARS else flat[: MAX_ERROR_CHARS - 1] + "…"


def _own_lines(log: logging.Logger) -> None:
    """JSON lines go alone to the real stderr (not through Celery's prefix), unless someone
    gave the logger handlers already."""
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
