"""docker-compose.yml and the Procfile, checked offline (no Docker engine needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from harvest.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_passes_the_compose_specification() -> None:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_depends_on_names_a_service() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on missing service {dependency}"
    roles = {
        "postgres",
        "redis",
        "migrate",
        "schedule",
        "execution",
        "beat",
        "flower",
        "metrics",
        "web",
    }
    assert roles <= set(services)


def test_flower_is_never_started_without_credentials() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    flower = compose["services"]["flower"]
    assert flower["ports"] == ["127.0.0.1:5555:5555"]
    assert "--basic-auth" in " ".join(flower["command"])
    procfile = (ROOT / "Procfile").read_text()
    line = next(x for x in procfile.splitlines() if x.startswith("flower:"))
    assert "--basic-auth" in line and "--address=127.0.0.1" in line


def test_procfile_runs_every_role() -> None:
    roles = {
        line.split(":", 1)[0]
        for line in (ROOT / "Procfile").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert roles == {"release", "schedule", "execution", "beat", "flower", "metrics", "web"}


def test_metrics_listen_on_loopback_only() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    metrics = compose["services"]["metrics"]
    assert metrics["command"][:2] == ["harvest", "metrics"]
    assert metrics["ports"] == ["127.0.0.1:9808:9808"]
    assert "migrate" in metrics["depends_on"]
    procfile = (ROOT / "Procfile").read_text()
    line = next(x for x in procfile.splitlines() if x.startswith("metrics:"))
    assert "harvest metrics --host 127.0.0.1" in line


def _seconds(duration: str) -> float:
    """A compose duration such as ``45s``, ``1m30s`` or ``2m``, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_docker_waits_for_the_execution_workers_warm_shutdown() -> None:
    """`docker compose stop` gives a container ``stop_grace_period`` (10 s unless set) between
    its SIGTERM and its SIGKILL: the execution workers' must cover the async jobs' grace
    (``HARVEST_SHUTDOWN_GRACE``, default or as the file sets it) and the hand-back after it."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    execution = compose["services"]["execution"]
    grace = float(
        (execution.get("environment") or {}).get(
            "HARVEST_SHUTDOWN_GRACE", Settings.model_fields["shutdown_grace"].default
        )
    )
    assert _seconds(execution.get("stop_grace_period", "10s")) >= grace + 10
