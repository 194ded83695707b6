"""harvest.install(app) on a Celery app of the project's own: its tasks, queue and beat entry
keep working, harvest's jobs run on its workers and beat, and its configuration is kept."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.models import JobStatus
from harvest.procs import ProcessGroup
from harvest.settings import Settings
from tests.processes.conftest import FAST, wait_until

pytestmark = pytest.mark.slow

MERGED = {"task_queues", "task_routes", "beat_schedule", "worker_consumer"}


def effects_of(engine: Engine, job_id: int) -> int:
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM test_effects WHERE job_id = :id"), {"id": job_id}
        )
        return int(found.scalar_one())


def test_an_installed_app_runs_its_own_tasks_and_harvests_jobs(
    migrated: Settings,
    clean_db: Engine,
    redis_client: object,
    effects: Engine,
    client_app: Harvest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {
        **FAST,
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    user = importlib.reload(importlib.import_module("tests.processes.user_celery"))
    after = {key: user.app.conf[key] for key in user.app.conf}
    assert {k for k in after if after[k] != user.BEFORE.get(k)} == MERGED
    assert [q.name for q in after["task_queues"]] == ["user", "schedule", "execution"]
    assert set(after["beat_schedule"]) >= {"user-heartbeat", "harvest-dispatch"}

    group = ProcessGroup(env, tmp_path, app="tests.processes.user_celery")
    try:
        group.worker("user", concurrency=1)
        group.worker("schedule", concurrency=1)
        group.worker("execution", concurrency=2)
        group.beat()
        group.wait_ready()
        ref = client_app.enqueue("effect", {})
        failing = client_app.enqueue("permanent_failure", {})
        user.add.delay(20, 22)
        assert client_app.wait(ref.id, timeout=60).status is JobStatus.SUCCEEDED
        assert client_app.wait(failing.id, timeout=60).status is JobStatus.FAILED
        wait_until(lambda: effects_of(effects, -42) == 1, 30, what="the project's own task")
        wait_until(lambda: effects_of(effects, -1) >= 2, 30, what="the project's beat entry")
        assert effects_of(effects, ref.id) == 1
    except Exception:
        print(group.logs())
        raise
    finally:
        group.stop()
