"""The Procfile under honcho, as the README runs it: the release step (migrations), then every
role (schedule and execution workers, beat, flower, metrics) against this run's services. A job
enqueued through the CLI is processed; stopping honcho leaves nothing running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine, text

from harvest.settings import Settings
from tests.processes.conftest import wait_until
from tests.processes.leftovers import free_port, processes_with, wait_none_left

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
AUTH = ("ops", "honcho-test-pw")
ROLES = ("schedule", "execution", "beat", "flower", "metrics", "web")


def honcho_env(settings: Settings, tmp_path: Path, marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARVEST_", "FLOWER_"))}
    return env | {
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # `harvest` and `celery` by name
        "PYTHONPATH": str(ROOT),
        "HARVEST_DATABASE_URL": settings.database_url,
        "HARVEST_REDIS_URL": settings.redis_url,
        "HARVEST_IMPORTS": "tests.jobs",
        "HARVEST_DEV_DIR": str(tmp_path),
        "HARVEST_DISPATCH_INTERVAL": "0.5",
        "HARVEST_METRICS_PORT": str(free_port()),
        "FLOWER_PORT": str(free_port()),
        "FLOWER_BASIC_AUTH": f"{AUTH[0]}:{AUTH[1]}",
        "HARVEST_WEB_PORT": str(free_port()),
        "HARVEST_WEB_USER": AUTH[0],
        "HARVEST_WEB_PASSWORD": AUTH[1],
        "HARVEST_TEST_MARKER": marker,
        "COLUMNS": "200",
    }


def run(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def answers(url: str, **kwargs: object) -> int | None:
    try:
        return httpx.get(url, timeout=5, **kwargs).status_code  # type: ignore[arg-type]
    except httpx.TransportError:
        return None


def test_honcho_runs_every_role_processes_a_job_and_leaves_nothing(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis, tmp_path: Path
) -> None:
    marker = f"honcho-{uuid.uuid4()}"
    env = honcho_env(migrated, tmp_path, marker)
    release = run(env, str(BIN / "honcho"), "-f", "Procfile", "run", "harvest", "db", "upgrade")
    assert re.fullmatch(r"database at \S+\n", release), release

    log_path = tmp_path / "honcho.log"
    with log_path.open("wb") as log:
        honcho = subprocess.Popen(
            [str(BIN / "honcho"), "start", "-f", "Procfile", "-c", "release=0"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    output = lambda: log_path.read_text(errors="replace")  # noqa: E731
    metrics = f"http://127.0.0.1:{env['HARVEST_METRICS_PORT']}/metrics"
    flower = f"http://127.0.0.1:{env['FLOWER_PORT']}"
    try:

        def all_up() -> bool:
            assert honcho.poll() is None, output()
            text_ = output()
            return bool(
                all(re.search(rf"^\S+ {role}\.1\s+\| ", text_, re.M) for role in ROLES)
                # the workers' banners (the Procfile logs at Celery's default level: no "ready.")
                and re.search(r"schedule\.1\s+\| .*-+ schedule@", text_)
                and re.search(r"execution\.1\s+\| .*-+ execution@", text_)
                and "celery beat v" in text_
                and answers(metrics) == 200
                and answers(f"{flower}/healthcheck") == 200
                and answers(f"http://127.0.0.1:{env['HARVEST_WEB_PORT']}/") == 401
            )

        wait_until(all_up, 120, 0.5, "every Procfile role to be up")
        for role in ROLES:
            assert f"{role}.1 started" in output()
        assert "release" not in output()

        job_id = int(run(env, "harvest", "enqueue", "echo", "--payload", '{"value": "honcho"}'))

        def succeeded() -> bool:
            with clean_db.connect() as conn:
                status = conn.execute(
                    text("SELECT status FROM harvest_jobs WHERE id = :id"), {"id": job_id}
                ).scalar_one()
            return bool(status == "succeeded")

        wait_until(succeeded, 90, 0.3, f"job {job_id} to succeed")
        shown = run(env, "harvest", "jobs", "show", str(job_id))
        assert re.search(r"│ status\s+│ succeeded", shown)
        assert '"value": "honcho"' in shown
        scraped = httpx.get(metrics, timeout=30).text
        assert 'harvest_jobs_by_name{name="echo",status="succeeded"} 1.0' in scraped
        assert answers(f"{flower}/") == 401  # flower, as the Procfile starts it, wants credentials
        assert answers(f"{flower}/api/workers") == 401
        assert answers(f"{flower}/", auth=AUTH) == 200
        assert len(processes_with(marker)) >= 2 * len(ROLES)  # the oracle sees them running
    finally:
        honcho.send_signal(signal.SIGTERM)
        try:
            honcho.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
            raise
        left = wait_none_left(marker, 30)
        for line in left:  # never leave them behind, even when the test fails
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert left == [], "\n".join(left)
    assert "SIGTERM received" in output()
    for role in ROLES:
        assert re.search(rf"{role}\.1 stopped \(rc=", output()), output()[-3000:]
    assert answers(metrics) is None and answers(f"{flower}/healthcheck") is None
    time.sleep(0.5)
    assert processes_with(marker) == []
