"""`harvest demo` as a user runs it (the README's first command, smaller): it finishes, the
summary shows every job succeeded with the key pool at work, no secret is printed, and nothing
it started is left running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, text

from harvest.settings import Settings
from tests.processes.leftovers import wait_none_left

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def row(table: str, label: str) -> str:
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if len(cells) >= 2 and cells[0].startswith(label):
            return cells[1] if len(cells) == 2 else " | ".join(cells[1:])
    raise AssertionError(f"no row {label!r} in:\n{table}")


@pytest.mark.timeout(600)
def test_demo_runs_end_to_end_and_leaves_nothing_running(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis, tmp_path: Path
) -> None:
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
        [str(BIN / "harvest"), "demo", "--jobs", "300"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    left = wait_none_left(marker, 30)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert left == [], "\n".join(left)

    out = done.stdout
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
    with clean_db.connect() as conn:
        jobs = conn.execute(text("SELECT status, count(*) FROM harvest_jobs GROUP BY status")).all()
        keys = conn.execute(text("SELECT count(*) FROM harvest_api_keys")).scalar_one()
    assert dict(jobs) == {"succeeded": 300}
    assert keys == 0  # the made-up keys are removed at the end


def test_the_demo_api_enforces_each_keys_limits() -> None:
    """The service, not harvest, enforces the limits: over them it answers 429 + Retry-After."""
    import threading

    import httpx

    from harvest.demo import DemoApi, DemoKey, retry_after

    key = DemoKey("k", 1, "3/s", api_concurrency=1, api_rate=(3, 1.0))
    api = DemoApi({"sk-demo-one": key, "sk-demo-two": key}, error_rate=0.0, latency=(0.2, 0.2))
    base = api.start()
    try:
        one = httpx.Client(headers={"Authorization": "Bearer sk-demo-one"}, timeout=10)
        assert httpx.get(f"{base}/page/1", timeout=10).status_code == 401  # no key
        bad = httpx.get(f"{base}/page/1", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert bad.status_code == 401
        answers = [one.get(f"{base}/page/{i}") for i in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]  # 3 per second
        assert answers[0].json()["bytes"] > 0
        assert retry_after(answers[3].headers["Retry-After"]) == 1.0

        two = httpx.Client(headers={"Authorization": "Bearer sk-demo-two"}, timeout=10)
        codes: list[int] = []
        calls = [
            threading.Thread(target=lambda: codes.append(two.get(f"{base}/p").status_code))
            for _ in range(2)
        ]
        for t in calls:
            t.start()
        for t in calls:
            t.join()
        assert sorted(codes) == [200, 429]  # one call at a time per key
        assert [(r.name, r.ok, r.http_429) for r in api.report()] == [("k", 3, 1), ("k", 1, 1)]
        assert api.http_429 == 2
        one.close()
        two.close()
    finally:
        api.stop()

    failing = DemoApi({"sk-demo-x": key}, error_rate=1.0, latency=(0.0, 0.0))
    base = failing.start()
    try:
        got = httpx.get(f"{base}/p", headers={"Authorization": "Bearer sk-demo-x"}, timeout=10)
        assert got.status_code == 500
        assert failing.report()[0].http_500 == 1
    finally:
        failing.stop()
    assert retry_after(None) == 1.0 and retry_after("soon") == 1.0 and retry_after("2.5") == 2.5
