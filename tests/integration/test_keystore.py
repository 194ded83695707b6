"""harvest.keystore against real Postgres and Redis: keys stored encrypted, refused at the door,
race-safe to add, and the live pool rebuilt from Postgres when Redis loses it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from harvest import keystore, migrate
from harvest.coordination.key_pool import Busy, KeyPool, Lease
from harvest.coordination.rate_limit import Rate
from harvest.db import make_engine
from harvest.errors import ConfigurationError, InvalidKey
from harvest.keystore import Cipher, KeyInfo, KeyNotFound, LastUsedBuffer
from harvest.models import Base
from harvest.settings import Settings

OWNER_KEY = "harvest:test:owner"
SENTINEL = "sk-SENTINEL-7f3a9c1e5b2d4f6a8c0e1b3d5f7a9c2e"


@pytest.fixture
def cipher(settings: Settings) -> Cipher:
    key = Fernet.generate_key().decode()
    return Cipher.from_settings(settings.model_copy(update={"secret_key": SecretStr(key)}))


@pytest.fixture
def db(clean_db: Engine) -> Engine:
    return clean_db


def add(engine: Engine, cipher: Cipher, **kwargs: Any) -> tuple[KeyInfo, bool]:
    values: dict[str, Any] = {"pool": "ai", "name": "main", "secret": SENTINEL} | kwargs
    with Session(engine) as session, session.begin():
        return keystore.add_key(session, cipher, **values)


def count_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM harvest_api_keys")).scalar_one())


def flushdb(client: redis.Redis) -> None:
    """Redis loses everything (this run keeps its claim on the db number)."""
    owner = client.get(OWNER_KEY)
    client.flushdb()
    if owner is not None:
        client.set(OWNER_KEY, owner, ex=4 * 3600)


# --- schema ---------------------------------------------------------------------------------


def test_migration_matches_the_model(engine: Engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "version_table": migrate.VERSION_TABLE,
                "compare_type": True,
                "compare_server_default": True,
            },
        )
        diff = list(compare_metadata(context, Base.metadata))
    assert [d for d in diff if "harvest_api_keys" in repr(d)] == []


def test_constraints_hold_in_the_database(db: Engine) -> None:
    insert = (
        "INSERT INTO harvest_api_keys (pool, name, secret_encrypted, secret_hint, "
        "max_concurrency, status) VALUES ('ai', :name, '\\x00', '…', :mc, :status)"
    )
    for name, mc, status in (("zero", 0, "active"), ("odd", 1, "sleeping")):
        with pytest.raises(Exception, match="check"), db.begin() as conn:
            conn.execute(text(insert), {"name": name, "mc": mc, "status": status})
    with db.begin() as conn:
        conn.execute(text(insert), {"name": "a", "mc": 1, "status": "active"})
    with pytest.raises(Exception, match="harvest_api_keys_pool_name_key"), db.begin() as conn:
        conn.execute(text(insert), {"name": "a", "mc": 1, "status": "active"})


# --- adding, listing, changing --------------------------------------------------------------


def test_add_list_disable_enable_rm(db: Engine, cipher: Cipher) -> None:
    main, created = add(db, cipher, max_concurrency=3, rate_limit=" 60 / m ")
    assert created
    assert (main.pool, main.name) == ("ai", "main")
    assert (main.max_concurrency, main.rate_limit) == (3, "60/m")
    assert main.status == "active" and main.hint == "sk-…9c2e"
    add(db, cipher, name="backup", secret="sk-other-secret-0000")
    add(db, cipher, pool="search", name="main", secret="plainsecretvalue")

    with db.connect() as conn:
        assert [(k.pool, k.name) for k in keystore.list_keys(conn)] == [
            ("ai", "backup"), ("ai", "main"), ("search", "main"),
        ]  # fmt: skip
        assert [k.name for k in keystore.list_keys(conn, "search")] == ["main"]
        assert keystore.list_keys(conn, "nope") == []

    with db.begin() as conn:
        assert keystore.set_status(conn, ("ai", "main"), "disabled").status == "disabled"
    with db.begin() as conn:
        until = datetime.now(UTC) + timedelta(minutes=5)
        cooling = keystore.set_status(conn, main.id, "cooling", until)
        assert cooling.status == "cooling" and cooling.cooldown_until == until
    with db.begin() as conn:
        enabled = keystore.set_status(conn, ("ai", "main"), "active")
        assert enabled.status == "active" and enabled.cooldown_until is None
    with db.begin() as conn:
        assert keystore.remove_key(conn, ("ai", "main")).id == main.id
    with db.connect() as conn:
        assert [k.name for k in keystore.list_keys(conn, "ai")] == ["backup"]
        with pytest.raises(KeyNotFound, match="'main' in pool 'ai'"):
            keystore.get_key(conn, ("ai", "main"))
        with pytest.raises(KeyNotFound, match=f"id {main.id}"):
            keystore.set_status(conn, main.id, "disabled")
        with pytest.raises(KeyNotFound):
            keystore.remove_key(conn, ("ai", "main"))


def test_key_info_never_carries_the_secret(db: Engine, cipher: Cipher) -> None:
    info, _ = add(db, cipher)
    assert not any("secret" in f.name for f in dataclasses.fields(KeyInfo))
    with db.connect() as conn:
        shown = repr(info) + repr(keystore.list_keys(conn)) + repr(cipher)
    assert SENTINEL not in shown and SENTINEL[3:] not in shown


def test_adding_an_existing_name_returns_it_unchanged(db: Engine, cipher: Cipher) -> None:
    first, created = add(db, cipher, max_concurrency=2)
    again, created_again = add(db, cipher, secret="sk-another-one-1111", max_concurrency=9)
    assert created and not created_again
    assert again == first
    with db.connect() as conn:
        assert keystore.secret_for(conn, cipher, first.id) == SENTINEL


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("pool", {"pool": ""}),
        ("pool", {"pool": "has space"}),
        ("pool", {"pool": "x" * 201}),
        ("pool", {"pool": "{braces}"}),
        ("name", {"name": ""}),
        ("name", {"name": "n" * 201}),
        ("name", {"name": "tab\tname"}),
        ("max_concurrency", {"max_concurrency": 0}),
        ("max_concurrency", {"max_concurrency": 10_001}),
        ("max_concurrency", {"max_concurrency": True}),
        ("max_concurrency", {"max_concurrency": 2.5}),
        ("rate_limit", {"rate_limit": "60"}),
        ("rate_limit", {"rate_limit": "0/m"}),
        ("rate_limit", {"rate_limit": "60/fortnight"}),
        ("secret", {"secret": ""}),
        ("secret", {"secret": "   "}),
        ("secret", {"secret": f" {SENTINEL}\n"}),
        ("secret", {"secret": "s" * 16_385}),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored(
    db: Engine, cipher: Cipher, field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(InvalidKey) as caught:
        add(db, cipher, **kwargs)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"invalid {field}: ")
    assert isinstance(caught.value, ValueError)
    assert SENTINEL not in str(caught.value)
    assert count_rows(db) == 0


def test_bad_status_changes_are_refused(db: Engine, cipher: Cipher) -> None:
    info, _ = add(db, cipher)
    naive = datetime.now() + timedelta(minutes=1)
    cases: list[tuple[str, str, datetime | None]] = [
        ("status", "sleeping", None),
        ("cooldown_until", "cooling", None),
        ("cooldown_until", "active", datetime.now(UTC)),
        ("cooldown_until", "cooling", naive),
    ]
    for field, status, until in cases:
        with pytest.raises(InvalidKey) as caught, db.begin() as conn:
            keystore.set_status(conn, info.id, status, until)
        assert caught.value.field == field
    with db.connect() as conn:
        assert keystore.get_key(conn, info.id).status == "active"


# --- encryption -----------------------------------------------------------------------------


def test_without_a_master_key_nothing_is_stored(db: Engine, settings: Settings) -> None:
    assert settings.secret_key is None
    for candidate in (settings, settings.model_copy(update={"secret_key": SecretStr("  ")})):
        no_key = Cipher.from_settings(candidate)
        with pytest.raises(ConfigurationError) as caught:
            add(db, no_key)
        assert str(caught.value) == (
            "HARVEST_SECRET_KEY is not set: refusing to store an API key secret unencrypted"
        )
    assert count_rows(db) == 0


@pytest.mark.parametrize(
    "value",
    [
        "correct-horse-battery-staple",
        Fernet.generate_key().decode()[:-2] + "==",  # 31 bytes
        Fernet.generate_key().decode().rstrip("=") + "!",
        "a" * 44,
        "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA==",
    ],
)
def test_a_malformed_master_key_is_refused_without_echoing_it(
    settings: Settings, value: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Cipher.from_settings(settings.model_copy(update={"secret_key": SecretStr(value)}))
    message = str(caught.value)
    assert "HARVEST_SECRET_KEY" in message
    assert value not in message
    assert caught.value.__cause__ is None


def test_the_database_holds_only_ciphertext(db: Engine, cipher: Cipher) -> None:
    info, _ = add(db, cipher)
    with db.connect() as conn:
        row = conn.execute(
            text(
                "SELECT secret_encrypted, row_to_json(k)::text AS as_text "
                "FROM harvest_api_keys k WHERE id = :id"
            ),
            {"id": info.id},
        ).one()
        assert keystore.secret_for(conn, cipher, info.id) == SENTINEL
    stored = bytes(row.secret_encrypted)
    assert SENTINEL.encode() not in stored
    assert SENTINEL not in row.as_text and SENTINEL.encode().hex() not in row.as_text
    assert stored.startswith(b"gAAAAA")  # a Fernet token


def test_secret_for_needs_the_same_master_key(
    db: Engine, cipher: Cipher, settings: Settings
) -> None:
    info, _ = add(db, cipher)
    other = Cipher.from_settings(
        settings.model_copy(update={"secret_key": SecretStr(Fernet.generate_key().decode())})
    )
    with db.connect() as conn:
        with pytest.raises(ConfigurationError, match="another master key") as caught:
            keystore.secret_for(conn, other, info.id)
        assert SENTINEL not in str(caught.value)
        with pytest.raises(ConfigurationError, match="not set"):
            keystore.secret_for(conn, Cipher.from_settings(settings), info.id)
        with pytest.raises(KeyNotFound):
            keystore.secret_for(conn, cipher, info.id + 1000)


# --- concurrency ----------------------------------------------------------------------------


@pytest.fixture
def wide_engine(migrated: Settings, db: Engine) -> Iterator[Engine]:
    """An engine with a connection for each of 20 threads (the shared one has 6)."""
    eng = make_engine(migrated, pool_size=20)
    yield eng
    eng.dispose()


def test_twenty_threads_adding_the_same_key_make_one_row(
    wide_engine: Engine, cipher: Cipher
) -> None:
    barrier = threading.Barrier(20, timeout=30)
    results: list[tuple[KeyInfo, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            with Session(wide_engine) as session, session.begin():
                session.execute(text("SELECT 1"))  # hold a connection before the race starts
                barrier.wait()
                result = keystore.add_key(
                    session, cipher, pool="ai", name="shared", secret=f"sk-thread-{i:04d}"
                )
            with lock:
                results.append(result)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(results) == 20
    assert len({info.id for info, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert count_rows(wide_engine) == 1


# --- last used (write-behind) ---------------------------------------------------------------


def test_touch_last_used_writes_many_keys_in_one_statement(db: Engine, cipher: Cipher) -> None:
    a, _ = add(db, cipher, name="a")
    b, _ = add(db, cipher, name="b")
    t1 = datetime(2030, 1, 1, tzinfo=UTC)
    t0 = t1 - timedelta(hours=1)
    with db.begin() as conn:
        assert keystore.touch_last_used(conn, {a.id: t1, b.id: t0, 999_999: t1}) == 2
    with db.begin() as conn:
        keystore.touch_last_used(conn, {a.id: t0})  # older: never moves backwards
        assert keystore.touch_last_used(conn, {}) == 0
    with db.connect() as conn:
        assert keystore.get_key(conn, a.id).last_used_at == t1
        assert keystore.get_key(conn, b.id).last_used_at == t0


def test_last_used_buffer_flushes_per_window(db: Engine, cipher: Cipher) -> None:
    a, _ = add(db, cipher, name="a")
    b, _ = add(db, cipher, name="b")
    now = [100.0]
    buffer = LastUsedBuffer(flush_every=5.0, clock=lambda: now[0])
    t = datetime(2030, 1, 1, tzinfo=UTC)
    for i in range(50):
        buffer.record(a.id, t + timedelta(seconds=i))
    buffer.record(b.id, t)
    assert buffer.pending() == 2
    now[0] += 4.9
    assert not buffer.due()
    assert buffer.flush(db) == 0
    now[0] += 0.2
    assert buffer.due()
    assert buffer.flush(db) == 2
    assert buffer.pending() == 0 and not buffer.due()
    with db.connect() as conn:
        assert keystore.get_key(conn, a.id).last_used_at == t + timedelta(seconds=49)
    buffer.record(b.id, t + timedelta(days=1))
    assert buffer.flush(db) == 0
    assert buffer.flush(db, force=True) == 1
    with db.connect() as conn:
        assert keystore.get_key(conn, b.id).last_used_at == t + timedelta(days=1)


def test_last_used_buffer_is_due_when_full() -> None:
    buffer = LastUsedBuffer(flush_every=3600, max_pending=3, clock=lambda: 0.0)
    for key_id in range(3):
        assert not buffer.due()
        buffer.record(key_id)
    assert buffer.due()
    with pytest.raises(ValueError, match="flush_every"):
        LastUsedBuffer(flush_every=0)


# --- keeping Redis in step ------------------------------------------------------------------


def lease_all(pool: KeyPool, n: int) -> list[Lease]:
    leases = []
    for _ in range(n):
        result = pool.lease("test", 30.0)
        if isinstance(result, Busy):
            break
        leases.append(result)
    return leases


def test_specs_for_pool_carry_limits_rates_and_status(db: Engine, cipher: Cipher) -> None:
    a, _ = add(db, cipher, name="a", max_concurrency=4, rate_limit="10/2s")
    b, _ = add(db, cipher, name="b")
    add(db, cipher, pool="other", name="c")
    until = datetime.now(UTC) + timedelta(minutes=1)
    with db.begin() as conn:
        keystore.set_status(conn, b.id, "cooling", until)
    with db.connect() as conn:
        specs = keystore.specs_for_pool(conn, "ai")
    assert [s.key_id for s in specs] == [a.id, b.id]
    assert specs[0].max_concurrency == 4
    # the declared rate, enforced over a slightly longer window (keystore.guarded)
    assert specs[0].rate == keystore.guarded(Rate(10, 2.0))
    assert specs[1].status == "cooling" and specs[1].cooldown_until == until.timestamp()


def test_sync_pool_follows_key_changes(
    db: Engine, cipher: Cipher, redis_client: redis.Redis
) -> None:
    a, _ = add(db, cipher, name="a", max_concurrency=2)
    b, _ = add(db, cipher, name="b", max_concurrency=1)
    assert keystore.sync_pool(db, redis_client, "ai") == 2
    pool = KeyPool(redis_client, "ai")
    assert sorted(lease.key_id for lease in lease_all(pool, 10)) == [a.id, a.id, b.id]

    with db.begin() as conn:
        keystore.set_status(conn, ("ai", "a"), "disabled")
    keystore.sync_pool(db, redis_client, "ai")
    states = {s.key_id: s for s in pool.snapshot()}
    assert states[a.id].status == "disabled" and states[a.id].live_leases == 2

    with db.begin() as conn:
        keystore.remove_key(conn, ("ai", "b"))
    keystore.sync_pool(db, redis_client, "ai")
    assert [s.key_id for s in pool.snapshot()] == [a.id]
    with pytest.raises(InvalidKey, match="invalid pool"):
        keystore.sync_pool(db, redis_client, "no spaces allowed")


def test_ensure_pool_loaded_rebuilds_after_flushdb(
    db: Engine, cipher: Cipher, redis_client: redis.Redis
) -> None:
    a, _ = add(db, cipher, name="a", max_concurrency=2)
    off, _ = add(db, cipher, name="off", max_concurrency=5)
    with db.begin() as conn:
        keystore.set_status(conn, off.id, "disabled")
    pool = KeyPool(redis_client, "ai")
    assert keystore.ensure_pool_loaded(db, redis_client, "ai") is True  # never loaded yet
    assert keystore.ensure_pool_loaded(db, redis_client, "ai") is False
    assert [lease.key_id for lease in lease_all(pool, 10)] == [a.id, a.id]

    flushdb(redis_client)
    assert not pool.is_loaded()
    assert keystore.ensure_pool_loaded(db, redis_client, "ai") is True
    assert pool.is_loaded()
    leases = lease_all(pool, 10)
    assert [lease.key_id for lease in leases] == [a.id, a.id]  # limits and status came back
    assert all(pool.release(lease) for lease in leases)
    assert keystore.ensure_pool_loaded(db, redis_client, "ai") is False


def test_ensure_pool_loaded_rebuilds_once_under_contention(
    db: Engine, cipher: Cipher, redis_client: redis.Redis, settings: Settings
) -> None:
    add(db, cipher, name="a")
    rebuilt: list[bool] = []
    barrier = threading.Barrier(8, timeout=30)

    def worker() -> None:
        client = redis.Redis.from_url(settings.redis_url)
        try:
            barrier.wait()
            rebuilt.append(keystore.ensure_pool_loaded(db, client, "ai"))
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(rebuilt) == [False] * 7 + [True]
