"""The gate's reactions to what a service says about a key."""

from __future__ import annotations

import time

import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine

from harvest import keystore
from harvest.app import Harvest
from harvest.coordination.key_pool import Busy, Lease
from harvest.gate import Gate, Wait
from harvest.settings import Settings


def _gate(migrated: Settings, redis_client: redis.Redis) -> Gate:
    settings = migrated.model_copy(
        update={"secret_key": SecretStr(Fernet.generate_key().decode()), "key_wait": 0.2}
    )
    app = Harvest(settings, redis_client=redis_client)
    cipher = keystore.Cipher.from_settings(settings)
    with app.sessions.begin() as session:
        keystore.add_key(session, cipher, pool="p", name="only", secret="sk-gate-test-0123456789")
    keystore.sync_pool(app.engine, redis_client, "p")
    return Gate(app)


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
    assert isinstance(waited, Wait) and waited.seconds > 25  # cooling: nothing to lease

    redis_client.flushdb()  # Redis lost the pool; the rebuild comes from Postgres
    waited = gate.lease("p", job_id=3)
    assert isinstance(waited, Wait) and waited.seconds > 20


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
    assert isinstance(gate.pool("p").lease("x", 5), Busy)
