"""Token budgets through the gate, run in-process by the Runner (no Celery) against real Postgres
and Redis: a job's cost is reserved on the key it leases, what the handler reports with
``ctx.used`` is settled when the key is released (sync and async handlers alike), and a key
without room in its token window is not leased: the job is deferred without an attempt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine

from harvest import keystore, store
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.coordination.key_pool import KeyPool
from harvest.errors import InvalidOption
from harvest.models import JobStatus
from harvest.runner import Runner
from harvest.settings import Settings
from tests.helpers import body, claim_all

POOL = "llm"


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    settings = migrated.model_copy(
        update={"secret_key": SecretStr(Fernet.generate_key().decode()), "key_wait": 0.2}
    )
    harvest = Harvest(settings, redis_client=redis_client)
    cipher = keystore.Cipher.from_settings(settings)
    with harvest.sessions.begin() as session:
        keystore.add_key(session, cipher, pool=POOL, name="k", secret="sk-token-test-0123456789",
                         max_concurrency=10, tpm=1000)  # fmt: skip
    keystore.sync_pool(harvest.engine, redis_client, POOL)

    def cost(payload: dict[str, Any]) -> int:
        return int(payload["cost"])

    @harvest.job("tok_sync", pool=POOL, cost=cost, max_attempts=1)
    def tok_sync(ctx: JobContext, cost: int, used: int | None) -> None:
        if used is not None:
            ctx.used(tokens=used)

    @harvest.job("tok_async", pool=POOL, cost=cost, max_attempts=1)
    async def tok_async(ctx: JobContext, cost: int, used: int | None) -> None:
        if used is not None:
            ctx.used(tokens=used)

    @harvest.job("tok_free", pool=POOL)
    def tok_free(ctx: JobContext, used: int) -> None:
        ctx.used(tokens=used)

    yield harvest
    harvest.close()


def in_window(redis_client: redis.Redis) -> int:
    return KeyPool(redis_client, POOL).snapshot()[0].tokens_used


def run_one(app: Harvest, runner: Runner, effects: Engine, name: str, **payload: Any) -> int:
    ref = app.enqueue(name, payload)
    counts = runner.execute(body(claim_all(effects)))
    return ref.id if counts["started"] == 1 else -counts["deferred"]


def status(effects: Engine, job_id: int) -> store.Job:
    with effects.connect() as conn:
        job = store.get(conn, job_id)
    assert job is not None
    return job


def test_reserved_then_settled_with_what_sync_and_async_handlers_used(
    app: Harvest, runner: Runner, effects: Engine, redis_client: redis.Redis
) -> None:
    done = run_one(app, runner, effects, "tok_sync", cost=600, used=100)
    assert status(effects, done).status is JobStatus.SUCCEEDED
    assert in_window(redis_client) == 100  # 500 refunded
    run_one(app, runner, effects, "tok_async", cost=800, used=850)
    assert in_window(redis_client) == 950  # 50 charged beyond the reservation
    assert run_one(app, runner, effects, "tok_async", cost=100, used=None) == -1  # no room
    assert in_window(redis_client) == 950
    run_one(app, runner, effects, "tok_sync", cost=50, used=None)  # reservation stands
    assert in_window(redis_client) == 1000


def test_a_job_without_a_cost_is_not_held_back_but_its_use_is_charged(
    app: Harvest, runner: Runner, effects: Engine, redis_client: redis.Redis
) -> None:
    run_one(app, runner, effects, "tok_free", used=1000)
    assert in_window(redis_client) == 1000
    assert run_one(app, runner, effects, "tok_free", used=5) > 0  # no cost declared: no check
    assert run_one(app, runner, effects, "tok_sync", cost=1, used=1) == -1


def test_a_rebuilt_pool_keeps_the_budget(
    app: Harvest, runner: Runner, effects: Engine, redis_client: redis.Redis
) -> None:
    redis_client.delete(*redis_client.keys("harvest:pool:*"))  # Redis lost the pool
    job = status(effects, run_one(app, runner, effects, "tok_sync", cost=1001, used=1))
    assert job.status is JobStatus.FAILED and job.attempts == 1  # above the budget: never fits
    assert "more than any key of pool 'llm' allows" in (job.last_error or "")
    assert KeyPool(redis_client, POOL).snapshot()[0].tokens is not None


def test_bad_costs_are_refused_at_registration(app: Harvest) -> None:
    with pytest.raises(InvalidOption, match="cost"):
        app.job("no_pool", cost=10)(lambda ctx: None)
    for bad in (-1, 2.5, "10", True):
        with pytest.raises(InvalidOption, match="cost"):
            app.job("bad", pool=POOL, cost=bad)(lambda ctx: None)  # type: ignore[arg-type]
    assert "no_pool" not in app.jobs and "bad" not in app.jobs


def test_ctx_used_refuses_what_is_not_a_token_count() -> None:
    ctx = JobContext(job_id=1, attempt=1, max_attempts=1, name="j")
    for bad in (-1, 1.5, "3", None):
        with pytest.raises(InvalidOption, match="tokens"):
            ctx.used(tokens=bad)  # type: ignore[arg-type]
