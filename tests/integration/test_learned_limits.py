"""Limits learned from the service, end to end in-process (the Runner, real Postgres and Redis)
against the loopback service: a key declared with concurrency 4 whose true concurrency is 2 gets
429s at first, its effective limit comes down, and then the 429s stop while the jobs go on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine, text

from harvest import keystore, store
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.coordination.key_pool import KeyPool
from harvest.loopback import LoopbackHandle, LoopKey, start_loopback
from harvest.runner import Runner
from harvest.settings import Settings
from tests.helpers import body

POOL = "learned"
SECRET = "sk-learned-test-0123456789"


@pytest.fixture
def service() -> Iterator[LoopbackHandle]:
    key = LoopKey("k", SECRET, concurrency=4, true_concurrency=2)
    with start_loopback([key], latency=0.15, sigma=0.1, seed=7) as handle:
        yield handle


@pytest.fixture
def app(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis, service: LoopbackHandle
) -> Iterator[Harvest]:
    settings = migrated.model_copy(
        update={"secret_key": SecretStr(Fernet.generate_key().decode()), "key_wait": 10.0}
    )
    harvest = Harvest(settings, redis_client=redis_client)
    cipher = keystore.Cipher.from_settings(settings)
    with harvest.sessions.begin() as session:
        keystore.add_key(session, cipher, pool=POOL, name="k", secret=SECRET, max_concurrency=4)
    keystore.sync_pool(harvest.engine, redis_client, POOL)
    url = service.url + "/v1/call"

    @harvest.job("learned_call", pool=POOL, max_attempts=3, timeout=30)
    async def call(ctx: JobContext, i: int) -> None:
        async with ctx.aclient() as http:
            r = await http.post(url, json={"job": ctx.job_id, "attempt": ctx.attempt, "i": i})
        ctx.observe(r)
        if r.status_code == 429:
            ctx.rate_limited(float(r.headers.get("Retry-After", "1")))
        r.raise_for_status()

    yield harvest
    harvest.close()


def left(engine: Engine) -> int:
    with engine.connect() as conn:
        sql = "SELECT count(*) FROM harvest_jobs WHERE status NOT IN ('succeeded', 'failed')"
        return int(conn.execute(text(sql)).scalar_one())


def test_429s_stop_once_the_lower_true_limit_is_learned(
    app: Harvest, runner: Runner, effects: Engine, service: LoopbackHandle,
    redis_client: redis.Redis,
) -> None:  # fmt: skip
    jobs = 60
    app.enqueue_many("learned_call", [{"i": i} for i in range(jobs)])
    deadline = time.monotonic() + 120
    while left(effects) and time.monotonic() < deadline:
        with effects.begin() as conn:  # a message of at most 12 jobs, run at once
            claimed = store.claim_due(conn, limit=12, ttl=300)
        if claimed:
            runner.execute(body(claimed))
        else:
            time.sleep(0.05)  # 429'd jobs wait their Retry-After
    assert left(effects) == 0
    log = service.log()
    statuses = [e["status"] for e in sorted(log, key=lambda e: e["start"])]
    assert statuses.count(200) == jobs
    assert 1 <= statuses.count(429) <= 6, "a few 429s teach the key its true concurrency"
    last_429 = max(i for i, s in enumerate(statuses) if s == 429)
    assert last_429 < 20, f"the 429s stop early, the last was call {last_429} of {len(log)}"
    key = KeyPool(redis_client, POOL).snapshot()[0]
    assert (key.max_concurrency, key.effective_max, key.learned) == (4, 2, True)
    assert key.lowered >= 1
    assert service.stats()["keys"]["k"]["peak_in_flight"] <= 2
