"""Job-level log lines, from the observer called directly: a success, a retry, a failure, a
lost outcome; logfmt and JSON; secrets inside an error masked."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from harvest.app import JobSpec
from harvest.errors import RateLimited
from harvest.execution import outcome
from harvest.execution.observe import AttemptEnded, AttemptStarted
from harvest.joblog import JobLog, logfmt
from harvest.jobs import Started
from harvest.retry import RetryPolicy

SECRET = "sk-live-0123456789abcdefwxyz"


def job(attempt: int = 1, max_attempts: int = 3) -> Started:
    return Started(7, uuid.uuid4(), "fetch_page", {}, attempt, max_attempts, 60.0, False)


def spec() -> JobSpec:
    return JobSpec(
        "fetch_page", lambda ctx: None, "execution", 3, 60.0, (Exception,), RetryPolicy(base=2.0)
    )


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    log = logging.getLogger("test.harvest.jobs")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield log, stream
    log.removeHandler(handler)


def run(observer: JobLog, started: Started, ended: outcome.Outcome, seconds: float = 0.25) -> None:
    observer.started(AttemptStarted(started, "host:42", 1_800_000_000.0))
    observer.ended(AttemptEnded(started, ended, seconds, "host:42", True, 1_800_000_000.25))


def test_logfmt_lines_of_a_success_a_retry_and_a_failure(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    log, stream = lines
    observer = JobLog("logfmt", log)
    run(observer, job(1), outcome.succeeded({"ok": True}))
    retry = outcome.raised(job(1), spec(), RuntimeError("upstream said 503"))
    run(observer, job(1), retry, seconds=0.5321)
    failed = outcome.raised(job(3), spec(), RuntimeError("still 503"))
    run(observer, job(3), failed)
    out = stream.getvalue().splitlines()
    assert out[0] == "INFO event=job.start job=7 name=fetch_page attempt=1/3 worker=host:42"
    assert out[1] == (
        "INFO event=job.end job=7 name=fetch_page attempt=1/3 outcome=succeeded "
        "duration_s=0.25 worker=host:42"
    )
    assert out[3] == (
        "WARNING event=job.end job=7 name=fetch_page attempt=1/3 outcome=retry "
        f"duration_s=0.532 retry_in_s={round(retry.retry_delay, 3)} "
        'error_type=RuntimeError error="upstream said 503" worker=host:42'
    )
    assert 1.0 <= retry.retry_delay <= 3.0  # the job's policy (base 2 s, with jitter)
    assert out[4].startswith("INFO event=job.start job=7 name=fetch_page attempt=3/3")
    assert out[5] == (
        "ERROR event=job.end job=7 name=fetch_page attempt=3/3 outcome=failed "
        'duration_s=0.25 error_type=RuntimeError error="still 503" worker=host:42'
    )


def test_secrets_inside_an_error_are_masked(lines: tuple[logging.Logger, io.StringIO]) -> None:
    log, stream = lines
    observer = JobLog("logfmt", log)
    exc = RuntimeError(f"key {SECRET} refused by postgresql://app:hunter2@db:5432/x")
    run(observer, job(3), outcome.raised(job(3), spec(), exc, secret=SECRET))
    # An error that reached the observer unmasked (not through harvest's outcome) is masked too.
    error = "OSError: redis://:hunter2@cache:6379/0"
    raw = outcome.Outcome(outcome.JobStatus.FAILED, error=error, error_type="OSError")
    run(observer, job(3), raw)
    text = stream.getvalue()
    assert SECRET not in text and "hunter2" not in text
    assert "sk-…wxyz" in text
    assert "postgresql://app:***@db:5432/x" in text
    assert "redis://:***@cache:6379/0" in text


def test_json_lines_and_what_a_rate_limited_attempt_says(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    log, stream = lines
    observer = JobLog("json", log)
    limited = outcome.raised(job(2), spec(), RateLimited(4.0), keyed=True)
    run(observer, job(2), limited)
    observer.ended(
        AttemptEnded(job(2), outcome.succeeded(None), 1.0, "host:42", False, 1_800_000_001.0)
    )
    start, end, lost = (json.loads(x.split(" ", 1)[1]) for x in stream.getvalue().splitlines())
    assert start == {
        "ts": "2027-01-15T08:00:00.000+00:00",
        "level": "info",
        "event": "job.start",
        "job": 7,
        "name": "fetch_page",
        "attempt": "2/3",
        "worker": "host:42",
    }
    assert end["outcome"] == "retry" and end["retry_in_s"] == 4.0
    assert end["attempt_counted"] is False  # the key's fault: the attempt was given back
    assert end["error_type"] == "RateLimited" and end["level"] == "warning"
    assert lost["recorded"] is False and lost["level"] == "warning"


def test_json_mode_writes_lines_alone_when_the_logger_has_no_handler(
    capfd: pytest.CaptureFixture[str],
) -> None:
    log = logging.getLogger("harvest.jobs")
    before = (list(log.handlers), log.propagate, log.level)
    try:
        log.handlers.clear()
        observer = JobLog("json")
        run(observer, job(1), outcome.succeeded(None))
        err = capfd.readouterr().err.splitlines()
        assert [json.loads(line)["event"] for line in err] == ["job.start", "job.end"]
    finally:
        log.handlers[:], log.propagate = before[0], before[1]
        log.setLevel(before[2])


def test_logfmt_quotes_what_needs_quoting() -> None:
    fields = {"a": 1, "b": "x y", "c": 'say "hi"', "d": "k=v", "e": True, "f": ""}
    assert logfmt(fields) == 'a=1 b="x y" c="say \\"hi\\"" d="k=v" e=true f=""'
    more = {"g": "C:\\tmp", "h": False, "i": None, "j": 0, "k": "ünïcode"}
    assert logfmt(more) == 'g="C:\\\\tmp" h=false i="" j=0 k=ünïcode'


def test_task_events_of_an_attempt_name_the_job_and_end_as_celery_would() -> None:
    """One attempt, one Celery task: received+started when it starts; SUCCESS, RETRY, FAILURE
    or REVOKED when it ends; nothing when its write was refused (another attempt owns it)."""
    from harvest.execution.observe import AttemptEnded, AttemptStarted
    from harvest.execution.outcome import Outcome
    from harvest.jobs import Started
    from harvest.models import JobStatus
    from harvest.worker.events import attempt_task_id, ended_events, started_events

    job = Started(7, uuid.uuid4(), "fetch", {"url": "https://u:pw@x.example/"}, 2, 3, 5.0, False)
    sent = started_events(AttemptStarted(job, "host:1", 0.0))
    assert [kind for kind, _ in sent] == ["task-received", "task-started"]
    received = sent[0][1]
    assert received["name"] == "fetch" and received["retries"] == 1
    assert received["uuid"] == attempt_task_id(7, 2) != attempt_task_id(7, 3)
    assert "pw" not in str(received["args"]) and "x.example" in str(received["args"])

    def ended(outcome: Outcome, recorded: bool = True) -> list[str]:
        return [k for k, _ in ended_events(AttemptEnded(job, outcome, 0.5, "h:1", recorded, 0.0))]

    assert ended(Outcome(JobStatus.SUCCEEDED, result_json="{}")) == ["task-succeeded"]
    assert ended(Outcome(JobStatus.PENDING, error="503", error_type="HTTPError")) == [
        "task-retried"
    ]
    failed = ended_events(
        AttemptEnded(job, Outcome(JobStatus.FAILED, error="boom", error_type="ValueError"),
                     0.5, "h:1", True, 0.0)
    )  # fmt: skip
    assert failed[0][0] == "task-failed" and failed[0][1]["exception"] == "ValueError('boom')"
    assert ended(Outcome(JobStatus.CANCELLED)) == ["task-revoked"]
    assert ended(Outcome(JobStatus.SUCCEEDED), recorded=False) == []


def test_job_events_follow_the_task_event_switch_across_fork() -> None:
    """Celery's rule for a task event (dispatcher enabled, the task group among its groups or
    none named), copied by the main process into a byte its forked children read: a child
    sends job events only while the switch is on; with no switch (HARVEST_TASK_EVENTS=true),
    always."""
    import os
    from types import SimpleNamespace

    from harvest.worker.events import EventSwitch, TaskEvents, sends_task_events

    def dispatcher(enabled: bool, groups: set[str]) -> SimpleNamespace:
        return SimpleNamespace(enabled=enabled, groups=groups)

    assert sends_task_events(dispatcher(True, set()))  # -E: every group
    assert not sends_task_events(dispatcher(True, {"worker"}))  # no -E: heartbeats only
    assert sends_task_events(dispatcher(True, {"worker", "task"}))  # after enable_events
    assert not sends_task_events(dispatcher(False, {"worker", "task"}))  # disabled
    assert not sends_task_events(None)

    switch = EventSwitch()
    assert not switch.on and not switch.set(False)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits for the parent to turn it on, then reports what it sees
        os.read(read, 1)
        os.write(write, b"1" if switch.on else b"0")
        os._exit(0)
    assert switch.set(True) and switch.on
    os.write(write, b"x")
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.close(write)

    job = Started(7, uuid.uuid4(), "fetch", {}, 1, 3, 5.0, False)
    start = AttemptStarted(job, "host:1", 0.0)
    sent: list[object] = []
    for follows, on, expected in ((switch, False, 0), (switch, True, 2), (None, False, 2)):
        switch.set(on)
        events = TaskEvents(None, "execution@host", follows)  # type: ignore[arg-type]
        events._put = lambda batch, at: sent.extend(batch)  # type: ignore[method-assign]
        sent.clear()
        events.started(start)
        assert len(sent) == expected, (follows, on)


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept() -> Iterator[tuple[logging.Logger, Keep]]:
    log = logging.getLogger("test.harvest.jobs.records")
    keep = Keep()
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield log, keep
    log.removeHandler(keep)


def test_a_job_line_is_the_record_logger_log_makes(kept: tuple[logging.Logger, Keep]) -> None:
    """The job log makes its records without Logger.log's per-record lookups; a handler or
    formatter must find in them all that Logger.log's record holds, with this line's own
    message, level, time and thread (also from another thread), and none of another line's."""
    log, keep = kept
    observer = JobLog(logger=log)
    run(observer, job(), outcome.succeeded(None))
    log.warning("%s", "reference")
    lines = []
    time.sleep(0.05)
    worker = threading.Thread(
        target=lambda: run(observer, job(), outcome.succeeded(None)), name="loop-thread"
    )
    worker.start()
    worker.join()
    start, end, reference, other_start, _ = keep.records
    assert set(vars(start)) == set(vars(reference))
    alike = {"name", "msg", "exc_info", "exc_text", "stack_info", "process", "processName",
             "thread", "threadName"}  # fmt: skip
    for key in alike:
        assert getattr(start, key) == getattr(reference, key), key
    assert (start.levelno, start.levelname, end.levelno) == (logging.INFO, "INFO", logging.INFO)
    # where Logger.log's stack walk found it: the job log's _emit
    assert (start.filename, start.module, start.funcName) == ("joblog.py", "joblog", "_emit")
    assert start.args == (start.getMessage(),)  # Logger.log(level, "%s", line)'s msg and args
    assert start.getMessage().startswith("event=job.start ")
    assert "outcome=succeeded" in end.getMessage()
    assert start.created <= end.created <= reference.created
    assert abs(reference.relativeCreated - end.relativeCreated) < 1000 * (
        reference.created - end.created + 0.01
    )
    assert int((start.created % 1) * 1000) == int(start.msecs)
    assert other_start.threadName == "loop-thread" and other_start.thread == worker.ident
    assert other_start.created - start.created >= 0.05  # each line its own time
    assert other_start.relativeCreated - start.relativeCreated >= 50
    formatter = logging.Formatter(
        "%(asctime)s %(name)s %(levelname)s %(process)d %(processName)s %(threadName)s "
        "%(filename)s:%(lineno)d %(funcName)s %(message)s"
    )
    for record in keep.records:
        lines.append(formatter.format(record))
    assert all(line.split()[3] == "INFO" or "reference" in line for line in lines)


def test_a_record_factory_of_your_own_still_makes_every_job_line(
    kept: tuple[logging.Logger, Keep],
) -> None:
    log, keep = kept
    before = logging.getLogRecordFactory()

    def tagged(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = before(*args, **kwargs)
        record.request_id = "r-1"  # type: ignore[attr-defined]
        return record

    logging.setLogRecordFactory(tagged)
    try:
        run(JobLog(logger=log), job(), outcome.succeeded(None))
    finally:
        logging.setLogRecordFactory(before)
    assert [getattr(r, "request_id", None) for r in keep.records] == ["r-1", "r-1"]


def test_a_forked_child_s_job_lines_carry_its_own_process_id(
    kept: tuple[logging.Logger, Keep],
) -> None:
    log, keep = kept
    observer = JobLog(logger=log)
    run(observer, job(), outcome.succeeded(None))  # the parent's record is made first
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a prefork pool's process
        try:
            keep.records.clear()
            run(observer, job(), outcome.succeeded(None))
            os.write(write, json.dumps([r.process for r in keep.records]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert keep.records[0].process == os.getpid()
    assert seen == [pid, pid]


@pytest.mark.parametrize(
    ("lines_setting", "expected"),
    [
        ("all", ["start 7", "end 7", "start 8", "end 8", "start 9", "end 9"]),
        ("ends", ["end 7", "end 8", "end 9"]),
        ("problems", ["end 8", "end 9"]),
    ],
)
def test_job_log_setting_chooses_which_lines(
    lines: tuple[logging.Logger, io.StringIO], lines_setting: Any, expected: list[str]
) -> None:
    """HARVEST_JOB_LOG: all lines, the end lines only, or only the ends of attempts that did
    not succeed: job 7 succeeds, job 8 is retried, job 9 succeeds but its outcome is dropped
    (another attempt owns the job), which counts as a problem."""
    log, stream = lines
    observer = JobLog("logfmt", log, lines=lines_setting)
    ok, retried, lost = (Started(i, uuid.uuid4(), "fetch_page", {}, 1, 3, 60.0, False)
                         for i in (7, 8, 9))  # fmt: skip
    run(observer, ok, outcome.succeeded({"ok": True}))
    run(observer, retried, outcome.raised(retried, spec(), RuntimeError("upstream said 503")))
    observer.started(AttemptStarted(lost, "host:42", 1_800_000_000.0))
    observer.ended(AttemptEnded(lost, outcome.succeeded(None), 0.1, "host:42", False, 1.8e9))
    seen = [
        f"{'start' if 'event=job.start' in line else 'end'} {line.split('job=')[1].split()[0]}"
        for line in stream.getvalue().splitlines()
    ]
    assert seen == expected


def test_job_log_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from harvest.settings import Settings

    monkeypatch.setenv("HARVEST_JOB_LOG", "problems")
    assert Settings().job_log == "problems"
    monkeypatch.setenv("HARVEST_JOB_LOG", "some")
    with pytest.raises(ValueError, match="job_log"):
        Settings()


def test_at_warning_only_the_problems_are_written(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    """Celery's default level (the README's worker commands): a start and a success write
    nothing, a retry and a failure their lines."""
    log, stream = lines
    log.setLevel(logging.WARNING)
    observer = JobLog("logfmt", log)
    run(observer, job(1), outcome.succeeded({"ok": True}))
    run(observer, job(1), outcome.raised(job(1), spec(), RuntimeError("503")))
    run(observer, job(3), outcome.raised(job(3), spec(), RuntimeError("503")))
    out = stream.getvalue().splitlines()
    assert [line.split(" ")[0] for line in out] == ["WARNING", "ERROR"]
    assert "outcome=retry" in out[0] and "outcome=failed" in out[1]
