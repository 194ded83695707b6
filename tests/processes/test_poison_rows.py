"""A row written around enqueue's checks with a time Python cannot read (issue 13): real
workers run every ordinary job beside it, the row ends failed with the reason, and the CLI, the
pages and the JSON API list it without error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.web import auth, create_app
from tests.helpers import statuses
from tests.processes.conftest import Cluster, wait_until
from tests.web.conftest import Server

pytestmark = pytest.mark.slow

HARVEST = str(Path(sys.executable).parent / "harvest")
ROOT = Path(__file__).resolve().parents[2]
# datetime(1, 1, 1, tzinfo=+23:59) as Postgres stores it; year 9999 at -23:59 becomes 10000.
TOO_EARLY = "0001-12-31 00:01:00+00 BC"
TOO_LATE = "10000-01-01 23:58:00+00"
INSERT = text(
    """
    INSERT INTO harvest_jobs (name, queue, payload, priority, run_at, max_attempts, timeout)
    VALUES ('noop', 'execution', '{}', 0, CAST(:run_at AS timestamptz), 3, 30)
    RETURNING id
    """
)


def harvest_cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
        "HARVEST_IMPORTS": "tests.jobs",
        "HARVEST_DATABASE_URL": cluster.settings.database_url,
        "HARVEST_REDIS_URL": cluster.settings.redis_url,
    }
    return subprocess.run(
        [HARVEST, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_a_row_with_an_unreadable_run_at_jams_nothing(
    cluster: Cluster, client_app: Harvest, engine: Engine
) -> None:
    with engine.begin() as conn:
        early = conn.execute(INSERT, {"run_at": TOO_EARLY}).scalar_one()
        late = conn.execute(INSERT, {"run_at": TOO_LATE}).scalar_one()
    ids = client_app.enqueue_many("noop", [{} for _ in range(1000)])
    cluster.up(execution=1, concurrency=4)
    try:
        wait_until(
            lambda: statuses(engine, ids).get("succeeded") == 1000, 120, 0.25, "1000 succeeded"
        )
        wait_until(lambda: statuses(engine, [early, late]) == {"failed": 2}, 10, 0.2, "failed")
    except AssertionError:
        print(statuses(engine, ids), cluster.logs())
        raise
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, last_error FROM harvest_jobs WHERE id = ANY(:ids) ORDER BY id"),
            {"ids": [early, late]},
        ).all()
        quarantined = store.counters(conn).get(store.QUARANTINED)
    assert [r.last_error for r in rows] == [
        f"quarantined: run_at {TOO_EARLY} is outside the times harvest can read (years 1 to 9999)",
        f"quarantined: run_at {TOO_LATE} is outside the times harvest can read (years 1 to 9999)",
    ]
    assert quarantined == 2
    logs = cluster.logs(tail=10**8)
    assert logs.count(f"job {early} (noop) quarantined (failed)") == 1  # logged once

    # Every reader lists it: the Python API, the CLI, the pages and the JSON API.
    job = client_app.get(early)
    assert job.run_at is None and job.status == "failed"
    assert job.unreadable == (f"run_at {TOO_EARLY} is outside the times harvest can read "
                              "(years 1 to 9999)",)  # fmt: skip
    listed = harvest_cli(cluster, "jobs", "ls", "--limit", "1100")
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert f"\n│ {early} " in listed.stdout.replace("┃", "│")
    shown = harvest_cli(cluster, "jobs", "show", str(early))
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert "quarantined: run_at" in shown.stdout
    credentials = auth.Credentials("operator", SecretStr("a-long-password"))
    with (
        Server(create_app(cluster.settings, credentials=credentials)) as server,
        httpx.Client(base_url=server.url, auth=("operator", "a-long-password")) as web,
    ):
        page = web.get("/jobs", params={"status": "failed"})
        assert page.status_code == 200 and f"/jobs/{early}" in page.text
        detail = web.get(f"/jobs/{early}")
        assert detail.status_code == 200 and "quarantined: run_at" in detail.text
        api = web.get("/api/jobs", params={"status": "failed"})
        assert api.status_code == 200
        listed_ids = {j["id"]: j for j in api.json()["jobs"]}
        assert listed_ids[early]["run_at"] is None
        assert listed_ids[late]["last_error"].startswith("quarantined: run_at 10000-01-01")
