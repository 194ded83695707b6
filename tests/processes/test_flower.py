"""Flower as the Procfile and docker-compose start it (basic auth, loopback): the dashboard and
the API refuse a request without credentials. Its /metrics and /healthcheck answer without
them (Flower 2.2 exempts both from auth): the README says so, and Flower stays off public
interfaces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harvest.settings import Settings
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
