"""Job-level log lines in a real execution worker's output: a success, a retry and a failure,
and a secret inside the error masked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harvest.app import Harvest
from harvest.models import JobStatus
from tests.processes.conftest import Cluster, wait_until

pytestmark = [
    pytest.mark.slow,
]

SECRET_URL = "postgresql://app:hunter2@db.internal:5432/prod"


def job_lines(log_dir: Path, fmt: str) -> list[dict[str, Any]]:
    """Every job-level line the execution workers wrote, as fields."""
    found = []
    for path in log_dir.glob("worker-execution-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if fmt == "json" and line.startswith("{"):
                found.append(json.loads(line))
            elif fmt == "logfmt" and "event=job." in line:
                pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.split("] ", 1)[-1])
                found.append({k: v.strip('"') for k, v in pairs})
    return found


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_a_success_a_retry_and_a_failure_each_log_their_attempts(
    cluster: Cluster, client_app: Harvest, fmt: str
) -> None:
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=1, HARVEST_LOG_FORMAT=fmt)
    cluster.beat()
    cluster.wait_ready()
    ok = client_app.enqueue("echo", {"value": 1})
    bad = client_app.enqueue("always_fails", {"message": f"cannot reach {SECRET_URL}"})
    wait_until(lambda: client_app.get(bad.id).status is JobStatus.FAILED, 60, what="dead job")
    assert client_app.get(ok.id).status is JobStatus.SUCCEEDED
    lines = job_lines(cluster.log_dir, fmt)
    mine = [x for x in lines if str(x["job"]) in (str(ok.id), str(bad.id))]
    seen = [(str(x["job"]), x["event"], x.get("outcome"), str(x["attempt"])) for x in mine]
    assert seen == [
        (str(ok.id), "job.start", None, "1/3"),
        (str(ok.id), "job.end", "succeeded", "1/3"),
        (str(bad.id), "job.start", None, "1/3"),
        (str(bad.id), "job.end", "retry", "1/3"),
        (str(bad.id), "job.start", None, "2/3"),
        (str(bad.id), "job.end", "retry", "2/3"),
        (str(bad.id), "job.start", None, "3/3"),
        (str(bad.id), "job.end", "failed", "3/3"),
    ], cluster.logs()
    retries = [x for x in mine if x.get("outcome") == "retry"]
    assert all(float(x["retry_in_s"]) > 0 for x in retries)
    failed = mine[-1]
    assert failed["error_type"] == "RuntimeError"
    assert "postgresql://app:***@db.internal:5432/prod" in failed["error"]
    assert "hunter2" not in cluster.logs(tail=10**7)


def test_harvest_job_log_problems_writes_only_the_attempts_that_did_not_succeed(
    cluster: Cluster, client_app: Harvest
) -> None:
    """``HARVEST_JOB_LOG=problems`` (busy workers whose successes need no line): no start line,
    no line for a job that succeeded, an end line for each retry and the failure."""
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=1, HARVEST_JOB_LOG="problems")
    cluster.beat()
    cluster.wait_ready()
    ok = client_app.enqueue("echo", {"value": 1})
    bad = client_app.enqueue("always_fails", {"message": "upstream said 503"})
    wait_until(lambda: client_app.get(bad.id).status is JobStatus.FAILED, 60, what="dead job")
    assert client_app.get(ok.id).status is JobStatus.SUCCEEDED
    lines = job_lines(cluster.log_dir, "logfmt")
    seen = [(str(x["job"]), x["event"], x.get("outcome"), str(x["attempt"])) for x in lines]
    assert seen == [
        (str(bad.id), "job.end", "retry", "1/3"),
        (str(bad.id), "job.end", "retry", "2/3"),
        (str(bad.id), "job.end", "failed", "3/3"),
    ], cluster.logs()
