"""Flower as the Procfile and docker-compose start it (basic auth, loopback): the dashboard and
the API refuse a request without credentials. Its /metrics and /healthcheck answer without
them (Flower 2.2 exempts both from auth): the README says so, and Flower stays off public
interfaces."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from harvest.app import Harvest
from harvest.settings import Settings
from tests.processes.conftest import Cluster, wait_until
from tests.processes.leftovers import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "ops", "flower-test-pw"


@pytest.fixture(scope="module")
def flower(migrated: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Flower for the module, on this run's broker (its Redis db)."""
    tmp_path = tmp_path_factory.mktemp("flower")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARVEST_", "FLOWER_"))}
    env |= {
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "PYTHONPATH": str(ROOT),
    }
    log = (tmp_path / "flower.log").open("wb")
    proc = subprocess.Popen(
        [
            str(BIN / "celery"), "-A", "workers", "flower", "--address=127.0.0.1",
            f"--port={port}", f"--basic-auth={USER}:{PASSWORD}", f"--db={tmp_path / 'flower'}",
        ],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/healthcheck", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp_path / "flower.log").read_text(errors="replace"))
            time.sleep(0.3)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@pytest.mark.parametrize("path", ["/", "/workers", "/tasks", "/api/workers", "/api/tasks"])
def test_dashboard_and_api_refuse_requests_without_credentials(flower: str, path: str) -> None:
    url = flower + path
    refused = httpx.get(url, timeout=30)
    assert refused.status_code == 401
    if not path.startswith("/api/"):  # the browser is asked for credentials
        assert "basic" in refused.headers.get("WWW-Authenticate", "").lower()
    assert httpx.get(url, auth=(USER, "wrong"), timeout=30).status_code == 401
    assert httpx.get(url, auth=(USER, PASSWORD), timeout=30).status_code == 200


def test_metrics_and_healthcheck_bypass_auth_as_documented(flower: str) -> None:
    """Flower's own choice (2.2): these two answer anyone. Hence loopback only."""
    health = httpx.get(f"{flower}/healthcheck", timeout=30)
    assert (health.status_code, health.text) == (200, "OK")
    metrics = httpx.get(f"{flower}/metrics", timeout=30)
    assert metrics.status_code == 200
    assert "flower_" in metrics.text
    readme = (ROOT / "README.md").read_text()
    assert "/metrics" in readme and "/healthcheck" in readme and "loopback" in readme


def test_each_job_attempt_is_a_task_in_flower_under_its_own_name(
    flower: str, cluster: Cluster, client_app: Harvest
) -> None:
    """Flower, reading Celery's events from real workers, lists harvest's jobs as tasks: one
    task per attempt under the job's name, a retried attempt as RETRY, the dead one as FAILURE
    with its exception, a success as SUCCESS; harvest's own ticks are not in the list."""
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=1)
    cluster.beat()
    # No -E: the worker sends task events once Flower's enable_events (sent every 5 s) reaches
    # it, and its execution children follow within a second; the worker logs that.
    wait_until(
        lambda: "job events on" in cluster.worker_logs("execution"),
        30,
        what="Flower's enable_events to turn the worker's job events on",
    )
    enqueued_at = time.time()
    ok = client_app.enqueue("echo", {"value": "hello"})
    dead = client_app.enqueue("always_fails", {"message": "flower-boom"})

    def tasks() -> dict[str, dict[str, object]]:
        got = httpx.get(f"{flower}/api/tasks", auth=(USER, PASSWORD), timeout=30)
        assert got.status_code == 200
        found: dict[str, dict[str, object]] = got.json()
        return found

    def settled() -> dict[str, dict[str, object]] | None:
        found = tasks()
        states = sorted(str(t.get("state")) for t in found.values())
        return found if states == ["FAILURE", "RETRY", "RETRY", "SUCCESS"] else None

    found = wait_until(settled, 60, interval=0.5, what="four attempts in Flower")
    by_name: dict[str, list[dict[str, object]]] = {}
    for task in found.values():
        by_name.setdefault(str(task["name"]), []).append(task)
    assert sorted(by_name) == ["always_fails", "echo"]  # no harvest.dispatch, no ticks
    [success] = by_name["echo"]
    assert success["state"] == "SUCCESS" and "hello" in str(success["result"])
    assert "hello" in str(success["args"])
    stamps = [success["received"], success["started"], success["succeeded"]]
    assert enqueued_at <= stamps[0] <= stamps[1] <= stamps[2] <= time.time(), stamps  # type: ignore[operator]
    failure = next(t for t in by_name["always_fails"] if t["state"] == "FAILURE")
    assert "flower-boom (attempt 3)" in str(failure["exception"])
    assert str(failure["worker"]).startswith("execution")
    assert client_app.get(ok.id).status.value == "succeeded"
    assert client_app.get(dead.id).status.value == "failed"


def test_celery_inspect_shows_job_names(cluster: Cluster, client_app: Harvest) -> None:
    """`celery inspect registered` lists the jobs an execution worker can run; `inspect
    active` shows a running job's id and name."""
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=1)
    cluster.beat()

    def inspect(*what: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", cluster.app, "inspect", *what, "--json",
             "-t", "2"],
            check=False, cwd=cluster.cwd, env=cluster.env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}

    def registered() -> list[str] | None:
        replies = inspect("registered")
        for node, names in replies.items():
            if node.startswith("execution") and isinstance(names, list):
                return [str(n) for n in names]
        return None

    names = wait_until(registered, 60, interval=1.0, what="the execution worker's reply")
    assert {"echo", "always_fails", "sleepy", "harvest.execute"} <= set(names)
    running = client_app.enqueue("sleepy", {"seconds": 10})

    def active() -> list[object] | None:
        for node, requests in inspect("active").items():
            if not node.startswith("execution") or not isinstance(requests, list):
                continue  # the schedule worker's ticks (no arguments) are active too at times
            for request in requests:
                for job in request["args"][0]:  # [[job id, lease token, job name], ...]
                    if job[0] == running.id:
                        return list(job)
        return None

    job = wait_until(active, 30, interval=1.0, what="the running job in inspect active")
    assert job[2] == "sleepy"


def test_celery_purge_drops_messages_not_jobs(cluster: Cluster, client_app: Harvest) -> None:
    """What the README says `celery purge` does: it empties the broker's queue, and the jobs
    whose messages it dropped come back by rescue after HARVEST_DISPATCH_TTL and run, once.
    Postgres holds the jobs; cancelling them there (`harvest jobs cancel`) is the way to drop
    them."""
    cluster.worker("schedule", concurrency=1)
    cluster.beat()
    ref = client_app.enqueue("echo", {"value": "kept"})
    wait_until(lambda: client_app.get(ref.id).status.value == "dispatched", 30, what="the dispatch")
    purged = subprocess.run(
        [sys.executable, "-m", "celery", "-A", cluster.app, "purge", "-f", "-Q", "execution"],
        check=False, cwd=cluster.cwd, env=cluster.env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert purged.returncode == 0 and "1 message" in purged.stdout, purged.stdout
    cluster.worker("execution", concurrency=1)
    job = client_app.wait(ref.id, timeout=60)
    assert job.status.value == "succeeded" and job.attempts == 1


def test_celery_revoke_skips_a_message_and_its_jobs_come_back(
    cluster: Cluster, client_app: Harvest
) -> None:
    """What the README says `celery control revoke` does: the worker does not run the revoked
    execution message, and its jobs come back by rescue after HARVEST_DISPATCH_TTL and run,
    once. The one execution process is kept busy (longer than the TTL) so that the message
    waits in the broker."""
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=1)
    cluster.beat()
    busy = client_app.enqueue("sleepy", {"seconds": 15})
    wait_until(lambda: client_app.get(busy.id).status.value == "running", 60, what="a busy worker")
    ref = client_app.enqueue("echo", {"value": "revoked"})
    broker = redis.Redis.from_url(client_app.settings.effective_broker_url)

    def waiting() -> str | None:
        for raw in broker.lrange("execution", 0, -1):
            message = json.loads(raw)
            args = json.loads(base64.b64decode(message["body"]))[0]
            if any(job[0] == ref.id for job in args[0]):
                return str(message["headers"]["id"])
        return None

    try:
        task_id = wait_until(waiting, 30, what="the job's message waiting in the broker")
    finally:
        broker.close()
    revoked = subprocess.run(
        [sys.executable, "-m", "celery", "-A", cluster.app, "control", "revoke", task_id],
        check=False, cwd=cluster.cwd, env=cluster.env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert revoked.returncode == 0, revoked.stdout + revoked.stderr
    assert client_app.get(busy.id).status.value == "running", "revoked too late to tell"
    job = client_app.wait(ref.id, timeout=90)
    assert job.status.value == "succeeded" and job.attempts == 1
    logs = cluster.worker_logs("execution")
    # The worker dropped the revoked message; the job ran from the one rescue sent afterwards.
    assert f"Discarding revoked task: harvest.execute[{task_id}]" in logs
    assert f"harvest.execute[{task_id}] succeeded" not in logs
