"""Fallback pools on real Celery workers and beat: while every key of the first pool is
disabled, jobs call the service with the second pool's keys and use one attempt each; after
``harvest keys enable``, new jobs call it with the first pool's keys again. The service's own
log of which key called is the oracle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.settings import Settings
from tests.processes.api_server import ApiServer, digest
from tests.processes.conftest import Cluster, wait_until, with_keys

pytestmark = pytest.mark.slow

KEYS = {"fb-first": ("a1", "a2"), "fb-second": ("b1",)}


def secret(pool: str, name: str) -> str:
    return f"sk-{pool}-{name}-0123456789abcdef"


@pytest.fixture
def keyed(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Settings:
    keys = [
        (pool, name, secret(pool, name), {"max_concurrency": 2})
        for pool, names in KEYS.items()
        for name in names
    ]
    return with_keys(migrated, redis_client, keys)


def keys_cli(cluster: Cluster, *args: str) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "harvest"), "keys", *args],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


_SUCCEEDED = text("SELECT count(*) FROM harvest_jobs WHERE id = ANY(:ids) AND status = 'succeeded'")


def run_jobs(client: Harvest, effects: Engine, name: str, url: str, n: int) -> list[int]:
    ids = client.enqueue_many(name, [{"url": url, "hold": 0.02} for _ in range(n)])

    def done() -> bool:
        with effects.connect() as conn:
            found = conn.execute(_SUCCEEDED, {"ids": ids}).scalar_one()
        return bool(found == n)

    wait_until(done, 120, 0.2, f"{n} {name} jobs to succeed")
    return ids


def served(effects: Engine, ids: list[int]) -> tuple[set[str], set[int]]:
    """(the pools that served, the attempts used) of jobs ``ids``."""
    with effects.connect() as conn:
        rows = conn.execute(
            text("SELECT result->>'pool', attempts FROM harvest_jobs WHERE id = ANY(:ids)"),
            {"ids": ids},
        ).all()
    return {r[0] for r in rows}, {r[1] for r in rows}


def test_the_second_pool_serves_while_the_first_is_disabled_then_the_first_again(
    keyed: Settings, effects: Engine, api: tuple[ApiServer, str], tmp_path: Path
) -> None:
    server, url = api
    cluster = Cluster(keyed, tmp_path)
    cluster.env["HARVEST_SECRET_KEY"] = keyed.secret_key.get_secret_value()  # type: ignore[union-attr]
    cluster.env["HARVEST_IMPORTS"] = "tests.jobs_fallback"
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=2)
    cluster.beat()
    client = Harvest(keyed)
    client.load_imports(["tests.jobs_fallback"])
    first = {digest(secret("fb-first", n)) for n in KEYS["fb-first"]}
    second = {digest(secret("fb-second", n)) for n in KEYS["fb-second"]}
    try:
        cluster.wait_ready()
        for name in KEYS["fb-first"]:
            keys_cli(cluster, "disable", "fb-first", name)
        ids = run_jobs(client, effects, "fallback_call", url, 12)
        ids += run_jobs(client, effects, "async_fallback_call", url, 12)
        assert {c.key for c in server.calls} == second  # the service saw only the second pool
        assert served(effects, ids) == ({"fb-second"}, {1})  # ctx.pool; no attempt used up

        for name in KEYS["fb-first"]:
            keys_cli(cluster, "enable", "fb-first", name)
        before = len(server.calls)
        ids = run_jobs(client, effects, "fallback_call", url, 8)
        assert {c.key for c in server.calls[before:]} <= first  # one at a time: always free
        assert served(effects, ids) == ({"fb-first"}, {1})
    except AssertionError:
        cluster.stop()
        print(cluster.logs())
        raise
    finally:
        client.close()
        cluster.stop()
