"""`harvest metrics` after a run on real workers: every documented series is served, and the
values agree with `harvest stats` and with the database, across a restart of the server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.coordination.key_pool import KeyPool, Lease
from harvest.metrics import SERIES
from harvest.settings import Settings
from tests.processes.conftest import Cluster, wait_until, with_keys
from tests.processes.leftovers import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
SENTINEL = "sk-SENTINEL-metrics-7c1d9e3f5a7b9c1d3e5f7a9b"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def cli_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    return env | {
        "HARVEST_DATABASE_URL": settings.database_url,
        "HARVEST_REDIS_URL": settings.redis_url,
        "HARVEST_IMPORTS": "tests.jobs",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }


class MetricsServer:
    """`harvest metrics` as a user starts it, on a free loopback port."""

    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(BIN / "harvest"), "metrics", "--port", str(self.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first == f"serving metrics on http://127.0.0.1:{self.port}/metrics\n", (
            first + self.proc.stderr.read()  # type: ignore[union-attr]
        )

    def scrape(self) -> tuple[str, Samples]:
        body = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=30).text
        samples: Samples = {}
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return body, samples

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self.proc.kill()


@pytest.fixture
def keyed(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Settings:
    """Pool "mx": key a (3 at once, 5/s), key b (2 at once), key c (disabled)."""
    keys = [
        ("mx", name, f"{SENTINEL}-{name}", {"max_concurrency": concurrency, "rate_limit": rate})
        for name, concurrency, rate in (("a", 3, "5/s"), ("b", 2, None), ("c", 4, None))
    ]
    return with_keys(migrated, redis_client, keys, disabled=[("mx", "c")])


@pytest.fixture
def server(keyed: Settings) -> Iterator[MetricsServer]:
    s = MetricsServer(cli_env(keyed))
    yield s
    s.proc.kill()
    s.proc.wait(10)


def stats_rows(env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        [str(BIN / "harvest"), "stats"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def test_metrics_agree_with_stats_and_the_database(
    keyed: Settings,
    cluster: Cluster,
    client_app: Harvest,
    server: MetricsServer,
    redis_client: redis.Redis,
) -> None:
    cluster.up(execution=1, concurrency=2)
    cluster.wait_ready()
    client_app.enqueue_many("echo", [{"value": i} for i in range(20)])
    client_app.enqueue_many("permanent_failure", [{}, {}])
    client_app.enqueue("always_fails", {})  # three attempts, then dead
    client_app.enqueue("noop", {}, delay=600)  # stays pending

    def finished() -> bool:
        with client_app.engine.connect() as conn:
            return (
                conn.execute(
                    text("SELECT count(*) FROM harvest_jobs WHERE finished_at IS NOT NULL")
                ).scalar_one()
                == 23
            )

    wait_until(finished, 120, 0.3, "23 jobs to finish")
    cluster.stop()
    lease = KeyPool(redis_client, "mx").lease("metrics-test", 300.0)
    assert isinstance(lease, Lease)

    body, m = server.scrape()
    rows = stats_rows(cli_env(keyed))

    # Every documented series is served (with its help), and nothing undocumented.
    served = set(re.findall(r"^# HELP (\S+) ", body, re.M))
    assert served == {s.name for s in SERIES}
    assert SENTINEL not in body

    # depth by queue and status
    depth = {k: v for k, v in m.items() if k[0] == "harvest_jobs"}
    assert depth == {
        ("harvest_jobs", (("queue", "execution"), ("status", "succeeded"))): 20.0,
        ("harvest_jobs", (("queue", "execution"), ("status", "failed"))): 3.0,
        ("harvest_jobs", (("queue", "execution"), ("status", "pending"))): 1.0,
    }
    for (_, labels), value in depth.items():
        queue, status = dict(labels)["queue"], dict(labels)["status"]
        assert rows[f"depth {queue} / {status}"] == str(int(value))

    # per job name and outcome, from the jobs table
    with client_app.engine.connect() as conn:
        db = {
            (r.name, r.status): r.n
            for r in conn.execute(
                text("SELECT name, status, count(*) AS n FROM harvest_jobs GROUP BY name, status")
            )
        }
    by_name = {
        (dict(k[1])["name"], dict(k[1])["status"]): int(v)
        for k, v in m.items()
        if k[0] == "harvest_jobs_by_name"
    }
    assert by_name == db
    assert by_name[("always_fails", "failed")] == 1

    # the last minute: outcomes, throughput, latencies, as `harvest stats` shows them
    def last(outcome: str) -> int:
        return int(m[("harvest_jobs_finished_last_minute", (("outcome", outcome),))])

    assert (last("succeeded"), last("failed"), last("cancelled")) == (20, 3, 0)
    assert rows["succeeded / failed / cancelled"] == "20 / 3 / 0"
    assert m[("harvest_jobs_retried_last_minute", ())] == 1.0
    assert rows["retried (2+ attempts)"] == "1"
    assert rows["throughput (last minute)"] == (
        f"{m[('harvest_throughput_jobs_per_second', ())]:.1f} jobs/s"
    )
    for series, row in (
        ("harvest_run_seconds", "run time p50/p95/p99"),
        ("harvest_enqueue_to_start_seconds", "enqueue-to-start p50/p95/p99"),
    ):
        values = [m[(series, (("quantile", q),))] for q in ("0.5", "0.95", "0.99")]
        assert rows[row] == " / ".join(ms(v) for v in values)
        assert 0 < values[0] <= values[1] <= values[2]

    # counters (Prometheus counters: _total)
    for key in ("rescued", "duplicate_deliveries_suppressed", "lost_outcomes_dropped"):
        assert rows[key.replace("_", " ")] == str(int(m[(f"harvest_{key}_total", ())]))
    assert "# TYPE harvest_rescued_total counter" in body

    # key pool utilisation
    def pool(series: str, **labels: str) -> float:
        return m[(series, tuple(sorted({"pool": "mx", **labels}.items())))]

    keys = [pool("harvest_key_pool_keys", status=s) for s in ("active", "cooling", "disabled")]
    assert keys == [2.0, 0.0, 1.0]
    assert rows["key pool mx: keys active / cooling / disabled"] == "2 / 0 / 1"
    assert pool("harvest_key_pool_leases") == 1.0
    assert pool("harvest_key_pool_capacity") == 5.0  # 3 + 2: the disabled key does not count
    assert pool("harvest_key_pool_utilisation") == pytest.approx(0.2)
    assert rows["key pool mx: leases / capacity"] == "1 / 5 (20%)"
    assert pool("harvest_key_pool_loaded") == 1.0
    leased = {"a", "b"} - {k for k in "ab" if pool("harvest_key_leases", key=k) == 0}
    assert len(leased) == 1
    assert pool("harvest_key_max_concurrency", key="a") == 3.0
    assert pool("harvest_key_rate_limit", key="a") == 5.0
    assert ("harvest_key_rate_limit", (("key", "b"), ("pool", "mx"))) not in m
    assert pool("harvest_key_status", key="c", status="disabled") == 1.0
    assert pool("harvest_key_status", key="c", status="active") == 0.0
    assert m[("harvest_up", (("service", "postgres"),))] == 1.0
    assert m[("harvest_up", (("service", "redis"),))] == 1.0

    # Nothing is kept in the server: a restarted one serves the same figures.
    assert server.stop() == 0
    again = MetricsServer(cli_env(keyed))
    try:
        _, m2 = again.scrape()
    finally:
        assert again.stop() == 0
    stable = [
        k
        for k in m
        if k[0] != "harvest_scrape_duration_seconds" and not k[0].endswith("_last_minute")
        and k[0] not in ("harvest_throughput_jobs_per_second", "harvest_run_seconds",
                         "harvest_enqueue_to_start_seconds")
    ]  # fmt: skip
    assert {k: m2.get(k) for k in stable} == {k: m[k] for k in stable}


def test_a_scrape_without_redis_still_answers(migrated: Settings, clean_db: Engine) -> None:
    env = cli_env(migrated) | {"HARVEST_REDIS_URL": "redis://127.0.0.1:1/0"}
    s = MetricsServer(env)
    try:
        _, m = s.scrape()
    finally:
        assert s.stop() == 0
    assert m[("harvest_up", (("service", "postgres"),))] == 1.0
    assert m[("harvest_up", (("service", "redis"),))] == 0.0
    assert ("harvest_rescued_total", ()) in m
