"""A heartbeat round renews the key leases first, and whatever the job-lease statement does:
a handler that runs holds its key and may call with it, so its key lease must not lapse while
Postgres is away (the key could go to another job: more calls at the service than the key's
concurrency). Both shells, their I/O replaced by recorders."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import redis

from harvest.coordination.key_pool import Lease
from harvest.execution import tracking
from harvest.execution.async_shell import AsyncShell
from harvest.execution.heartbeat import HeartbeatThread

POSTGRES_AWAY = psycopg.OperationalError("connection refused")
REDIS_AWAY = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379")


def running() -> tracking.Tracked:
    job = tracking.Tracked(7, uuid.uuid4(), "j", 1, max_attempts=3)
    job.key_lease = Lease("p", 1, "tok", 5, 1e9)
    return job


class Services:
    """Records what a round asks of Postgres ("jobs") and Redis ("keys"), failing as told."""

    def __init__(self, *, postgres: bool = True, redis: bool = True) -> None:
        self.postgres, self.redis = postgres, redis
        self.asked: list[str] = []

    def jobs(self, job_ids: list[int]) -> dict[int, bool]:
        self.asked.append("jobs")
        if not self.postgres:
            raise POSTGRES_AWAY
        return dict.fromkeys(job_ids, False)

    def keys(self, leases: list[Lease]) -> list[bool]:
        self.asked.append("keys")
        if not self.redis:
            raise REDIS_AWAY
        return [True] * len(leases)


def sync_round(services: Services, job: tracking.Tracked) -> None:
    shell: Any = SimpleNamespace(
        plan=SimpleNamespace(lease_ttl=30.0),
        app=SimpleNamespace(settings=SimpleNamespace(heartbeat_interval=10.0)),
        db=lambda query: services.jobs([job.job_id]),
        gate=SimpleNamespace(heartbeat_many=services.keys),
    )
    beat = HeartbeatThread(shell)
    beat._jobs[job.job_id] = job  # tracked without starting the thread
    beat.beat()


def async_round(services: Services, job: tracking.Tracked) -> None:
    async def run(query: Any) -> dict[int, bool]:
        return services.jobs([job.job_id])

    async def heartbeat_many(leases: list[Lease]) -> list[bool]:
        return services.keys(leases)

    shell: Any = SimpleNamespace(
        tracked={job.job_id: job},
        plan=SimpleNamespace(lease_ttl=30.0),
        writer=SimpleNamespace(run=run),
        gate=SimpleNamespace(heartbeat_many=heartbeat_many),
    )
    asyncio.run(AsyncShell.beat(shell))


ROUNDS = [sync_round, async_round]


@pytest.mark.parametrize("one_round", ROUNDS, ids=["sync", "async"])
def test_keys_are_renewed_while_postgres_is_away(one_round: Any) -> None:
    services, job = Services(postgres=False), running()
    before = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        one_round(services, job)  # the round fails (logged by the caller), after the keys
    assert services.asked == ["keys", "jobs"]
    assert job.key_fresh_until > before  # renewed: fresh again for most of its TTL
    assert not job.lost


@pytest.mark.parametrize("one_round", ROUNDS, ids=["sync", "async"])
def test_job_leases_are_renewed_while_redis_is_away(one_round: Any) -> None:
    services, job = Services(redis=False), running()
    with pytest.raises(redis.ConnectionError):
        one_round(services, job)
    assert services.asked == ["keys", "jobs"]  # the job leases' statement went out all the same
    assert not job.lost and not job.cancel.is_set()
