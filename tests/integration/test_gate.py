"""The gate's reactions to what a service says about a key."""

from __future__ import annotations

import time
import uuid

import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine

from harvest import keystore
from harvest.app import Harvest, JobSpec
from harvest.coordination.key_pool import Busy, Lease
from harvest.execution import core
from harvest.execution.executor import Executor
from harvest.execution.tracking import Tracked
from harvest.settings import Settings


class _Gate:
    """The core's gate driven by a worker's blocking shell, for one job of pool "p"."""

    def __init__(self, app: Harvest) -> None:
        self.app = app
        self.executor = Executor(app)
        self.shell = self.executor.sync
        self.gate = self.shell.gate

    def lease(self, pool: str, job_id: int) -> Lease | core.Wait | None:
        spec = JobSpec("j", lambda ctx: None, "execution", 1, 1.0, (Exception,), None, pool)  # type: ignore[arg-type]
        tracked = Tracked(job_id, uuid.uuid4(), "j")  # attempts allowed unknown: waits unstarted
        result = self.shell.drive(core.gate(spec, tracked, self.executor.plan))
        assert not isinstance(result, core.NotStarted | core.Refused)
        return result

    def secret(self, lease: Lease) -> str:
        return self.gate.secret(lease)

    def rate_limited(self, lease: Lease, seconds: float) -> None:
        self.gate.rate_limited(lease, seconds)

    def rejected(self, lease: Lease) -> None:
        self.gate.rejected(lease)

    def release(self, lease: Lease) -> None:
        self.gate.release(lease)

    def pool(self, name: str) -> object:
        return self.gate.pool(name)


def _gate(migrated: Settings, redis_client: redis.Redis) -> _Gate:
    settings = migrated.model_copy(
        update={"secret_key": SecretStr(Fernet.generate_key().decode()), "key_wait": 0.2}
    )
    app = Harvest(settings, redis_client=redis_client)
    cipher = keystore.Cipher.from_settings(settings)
    with app.sessions.begin() as session:
        keystore.add_key(session, cipher, pool="p", name="only", secret="sk-gate-test-0123456789")
    keystore.sync_pool(app.engine, redis_client, "p")
    return _Gate(app)


def test_a_429_cools_the_key_and_the_cooldown_survives_a_redis_flush(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    gate = _gate(migrated, redis_client)
    lease = gate.lease("p", job_id=1)
    assert isinstance(lease, Lease)
    assert gate.secret(lease) == "sk-gate-test-0123456789"
    gate.rate_limited(lease, 30)
    gate.release(lease)
    with gate.app.engine.connect() as conn:
        key = keystore.list_keys(conn, "p")[0]
    assert key.status == "cooling" and key.cooldown_until is not None
    assert 25 < key.cooldown_until.timestamp() - time.time() <= 31
    waited = gate.lease("p", job_id=2)
    assert isinstance(waited, core.Wait)  # cooling: nothing to lease; the job goes back to
    assert waited.seconds <= 0.2  # pending for key_wait at most (dispatch holds it back)
    busy = gate.gate.pool("p").lease("x", 5)
    assert isinstance(busy, Busy) and busy.retry_after > 25

    redis_client.flushdb()  # Redis lost the pool; the rebuild comes from Postgres
    waited = gate.lease("p", job_id=3)
    assert isinstance(waited, core.Wait)
    busy = gate.gate.pool("p").lease("x", 5)
    assert isinstance(busy, Busy) and busy.retry_after > 20


def test_a_rejected_key_is_disabled_everywhere(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    gate = _gate(migrated, redis_client)
    lease = gate.lease("p", job_id=1)
    assert isinstance(lease, Lease)
    gate.rejected(lease)
    gate.release(lease)
    with gate.app.engine.connect() as conn:
        assert keystore.list_keys(conn, "p")[0].status == "disabled"
    assert isinstance(gate.gate.pool("p").lease("x", 5), Busy)
