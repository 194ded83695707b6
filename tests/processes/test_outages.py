"""Once running, an outage of Postgres or Redis is logged once when it starts and once when it
ends (with a count), not once per tick, and the processes carry on after it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harvest.app import Harvest
from harvest.models import JobStatus
from harvest.settings import Settings
from tests.conftest import close_database
from tests.processes.conftest import Cluster, PrivateRedis, wait_until

pytestmark = pytest.mark.slow


def lines_with(log_dir: Path, prefix: str, text: str) -> list[str]:
    return [
        line
        for path in log_dir.glob(f"{prefix}*.log")
        for line in path.read_text(errors="replace").splitlines()
        if text in line
    ]


def test_a_postgres_outage_is_logged_once_with_a_count(
    own_database: Settings, redis_client: object, tmp_path: Path
) -> None:
    cluster = Cluster(own_database, tmp_path)
    app = Harvest(own_database)
    app.load_imports(["tests.jobs"])
    name = own_database.database_url.rsplit("/", 1)[1]
    try:
        cluster.worker("schedule", concurrency=1)
        cluster.worker("execution", concurrency=1)
        cluster.beat()
        cluster.wait_ready()
        # beat checks Postgres after it logs its start: a database closed before that check
        # stops beat (no ticks, no outage to log), so close it once beat is sending ticks
        wait_until(lambda: lines_with(tmp_path, "beat", "Sending due task"), 30, what="a tick")
        close_database(name, closed=True)
        time.sleep(5)  # 10 dispatch ticks (every 0.5 s), rescue ticks every 1 s
        close_database(name, closed=False)
        wait_until(
            lambda: lines_with(tmp_path, "worker-schedule", "Postgres answers again"),
            30,
            what="the recovery line",
        )
        ref = app.enqueue("echo", {"value": "after"})
        assert app.wait(ref.id, timeout=30).status is JobStatus.SUCCEEDED
        down = lines_with(tmp_path, "worker-schedule", "Postgres does not answer")
        up = lines_with(tmp_path, "worker-schedule", "Postgres answers again")
        assert len(down) == 1 and len(up) == 1, cluster.logs()
        failed = int(up[0].split("(")[-1].split(" failed")[0])
        assert failed >= 5, up[0]  # the ticks it skipped, counted on one line
        assert not lines_with(tmp_path, "worker-schedule", "Traceback"), cluster.logs()
    finally:
        close_database(name, closed=False)
        cluster.stop()
        app.close()


def test_a_redis_outage_is_logged_once_by_beat(
    migrated: Settings, tmp_path: Path, private_redis: PrivateRedis
) -> None:
    private = migrated.model_copy(update={"redis_url": private_redis.url})
    cluster = Cluster(private, tmp_path)
    try:
        cluster.beat()
        cluster.wait_ready()
        time.sleep(2)
        private_redis.kill()
        time.sleep(5)
        private_redis.start()
        wait_until(
            lambda: len(lines_with(tmp_path, "beat", "answers again")) == 2,
            30,
            what="both recovery lines",
        )
        logs = cluster.logs(tail=10**6)
        for service in ("Redis", "the broker"):
            assert len(lines_with(tmp_path, "beat", f"{service} does not answer")) == 1, logs
            assert len(lines_with(tmp_path, "beat", f"{service} answers again")) == 1, logs
        assert "Traceback" not in logs and "Message Error" not in logs, logs
    finally:
        cluster.stop()
