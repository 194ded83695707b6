"""`harvest demo` as a user runs it (the README's first command, smaller): it finishes, the
summary shows every job succeeded with the key pool at work, no secret is printed, and nothing
it started is left running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import Engine, text

from harvest import dev
from harvest.db import make_engine
from harvest.settings import Settings
from tests.conftest import ADMIN_URL
from tests.processes.leftovers import wait_none_left

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def row(table: str, label: str) -> str:
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if len(cells) >= 2 and cells[0].startswith(label):
            return cells[1] if len(cells) == 2 else " | ".join(cells[1:])
    raise AssertionError(f"no row {label!r} in:\n{table}")


@pytest.fixture
def demo_database(migrated: Settings) -> Iterator[tuple[str, Engine]]:
    """The name of the demo's own database for this test (on the test server), and an engine
    on it; dropped after."""
    name = f"harvest_test_{uuid.uuid4().hex[:8]}_demo"
    url = migrated.database_url.rsplit("/", 1)[0] + "/" + name
    engine = make_engine(Settings(database_url=url), pool_size=1)
    yield name, engine
    engine.dispose()
    dev.drop_database(url)


def databases() -> set[str]:
    with psycopg.connect(ADMIN_URL) as conn:
        return {r[0] for r in conn.execute("SELECT datname FROM pg_database")}


@pytest.mark.timeout(600)
def test_demo_runs_end_to_end_and_leaves_nothing_running(
    migrated: Settings,
    clean_db: Engine,
    redis_client: redis.Redis,
    tmp_path: Path,
    demo_database: tuple[str, Engine],
) -> None:
    database, demo_engine = demo_database
    marker = f"demo-{uuid.uuid4()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    env |= {  # no HARVEST_SECRET_KEY: the demo makes an ephemeral one
        "HARVEST_DEV_DIR": str(tmp_path / "dev"),
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "HARVEST_TEST_MARKER": marker,
        "COLUMNS": "200",
    }
    done = subprocess.run(
        [str(BIN / "harvest"), "demo", "--jobs", "300", "--database", database],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    left = wait_none_left(marker, 30)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert left == [], "\n".join(left)

    out = done.stdout
    # It says what it uses, and keeps its own database (never the test's, nor `harvest`).
    assert f"/{database}" in row(out, "postgres") and "from HARVEST_DATABASE_URL" in out
    assert "database created for the demo" in out
    assert migrated.redis_url in row(out, "redis")
    assert str(tmp_path / "dev" / "demo-logs") in row(out, "logs")
    assert f"database {database} kept" in out
    assert not (tmp_path / "dev" / "dev.json").exists()  # nothing recorded: it started nothing
    assert row(out, "succeeded") == "300"
    assert row(out, "failed (dead)") == "0"
    assert row(out, "not finished") == "0"
    assert re.fullmatch(r"\d+", row(out, "jobs/s"))
    assert re.fullmatch(r"[\d.]+ ms / [\d.]+ ms / [\d.]+ ms", row(out, "run time p50/p95/p99"))
    assert re.fullmatch(r"\d+", row(out, "429s seen"))
    assert re.fullmatch(r"\d+", row(out, "HTTP 500s seen"))
    assert row(out, "keys") == "4 in pool 'demo'"
    calls = 0
    for key in ("key-1", "key-2", "key-3", "key-4"):
        cells = row(out, key).split(" | ")
        ok = int(cells[-3])
        assert ok > 0, f"{key} was never used:\n{out}"
        calls += ok
    assert calls == 300  # one successful call per job: every job went through a leased key
    assert "key leases" in out  # the progress bar showed the pool's utilisation

    # No secret was printed or logged: neither a demo key nor the ephemeral master key.
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "dev").rglob("*.log"))
    for text_ in (out, done.stderr, logs):
        assert "sk-demo-" not in text_
        assert not re.search(r"[A-Za-z0-9_-]{43}=", text_)
    with demo_engine.connect() as conn:
        jobs = conn.execute(text("SELECT status, count(*) FROM harvest_jobs GROUP BY status")).all()
        keys = conn.execute(text("SELECT count(*) FROM harvest_api_keys")).scalar_one()
    assert dict(jobs) == {"succeeded": 300}
    assert keys == 0  # the made-up keys are removed at the end
    with clean_db.connect() as conn:  # the database HARVEST_DATABASE_URL names is untouched
        assert conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one() == 0

    again = subprocess.run(
        [str(BIN / "harvest"), "demo", "--jobs", "20", "--database", database, "--drop"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-5000:] + again.stderr[-5000:]
    assert "database already there" in again.stdout
    assert f"database {database} dropped" in again.stdout
    assert database not in databases()
    assert wait_none_left(marker, 30) == []


def test_the_demo_api_enforces_each_keys_limits() -> None:
    """The service (harvest.loopback, in its own process), not harvest, enforces the demo keys'
    limits: over them it answers 429 with Retry-After; the report counts per key."""
    import threading

    import httpx

    from harvest.demo import DemoApi, DemoKey, retry_after

    # Windows and latencies far from what a loaded machine can blur: 3 calls a minute, and
    # calls that take 1.5 s, so two started together surely overlap.
    one_key = DemoKey("one", 1, "3/min", api_concurrency=1, api_rate=(3, 60.0))
    two_key = DemoKey("two", 1, "3/s", api_concurrency=1, api_rate=(100, 1.0))
    api = DemoApi({"sk-demo-one": one_key}, error_rate=0.0, latency=0.01)
    slow = DemoApi({"sk-demo-two": two_key}, error_rate=0.0, latency=1.5)
    base, slow_base = api.start(), slow.start()
    try:
        assert httpx.post(f"{base}/v1/page/1", timeout=10).status_code == 401  # no key
        one = httpx.Client(headers={"Authorization": "Bearer sk-demo-one"}, timeout=10)
        answers = [one.post(f"{base}/v1/page/{i}", json={}) for i in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]  # 3 per minute
        assert 0 < retry_after(answers[3].headers["Retry-After"]) <= 60.0

        two = httpx.Client(headers={"Authorization": "Bearer sk-demo-two"}, timeout=10)
        codes: list[int] = []
        together = threading.Barrier(2)

        def call() -> None:
            together.wait()
            codes.append(two.post(f"{slow_base}/p", json={}).status_code)

        calls = [threading.Thread(target=call) for _ in range(2)]
        for t in calls:
            t.start()
        for t in calls:
            t.join()
        assert sorted(codes) == [200, 429]  # one call at a time per key
        assert [(r.name, r.ok, r.http_429) for r in api.report()] == [("one", 3, 1)]
        assert [(r.name, r.ok, r.http_429) for r in slow.report()] == [("two", 1, 1)]
        assert api.http_429 == 1
        one.close()
        two.close()
    finally:
        api.stop()
        slow.stop()
    assert api.report()[0].ok == 3  # the last figures outlive the service

    failing = DemoApi({"sk-demo-x": one_key}, error_rate=1.0, latency=0.01)
    base = failing.start()
    try:
        got = httpx.post(f"{base}/p", json={}, headers={"Authorization": "Bearer sk-demo-x"})
        assert got.status_code == 500
        assert failing.report()[0].http_500 == 1
    finally:
        failing.stop()
    assert retry_after(None) == 1.0 and retry_after("soon") == 1.0 and retry_after("2.5") == 2.5
