"""`harvest keys` as a user runs it: the console script in a subprocess, against real Postgres and
Redis. A planted secret must never show up in any output, any Redis key or value, or the row."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from cryptography.fernet import Fernet
from sqlalchemy import Engine, text

from harvest.coordination.key_pool import KeyPool, Lease
from harvest.settings import Settings

HARVEST = str(Path(sys.executable).parent / "harvest")
SENTINEL = "sk-SENTINEL-cli-4b8d2f6a0c3e5a7c9e1b3d5f7a9b2d4f"
OTHER = "sk-SENTINEL-env-1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d"


@dataclass
class Cli:
    env: dict[str, str]
    outputs: list[str] = field(default_factory=list)

    def run(
        self, *args: str, stdin: str = "", env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [HARVEST, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env or self.env,
            timeout=120,
            check=False,
        )
        self.outputs += [done.stdout, done.stderr]
        return done

    def ok(self, *args: str, stdin: str = "") -> str:
        done = self.run(*args, stdin=stdin)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stderr == ""
        return done.stdout

    def refused(self, *args: str, stdin: str = "", env: dict[str, str] | None = None) -> str:
        """A user mistake: non-zero exit, exactly one line on stderr, returned."""
        done = self.run(*args, stdin=stdin, env=env)
        assert done.returncode != 0, done.stdout
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "Traceback" not in done.stderr
        return lines[0]


@pytest.fixture
def cli(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Cli]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARVEST_")}
    env |= {
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "HARVEST_SECRET_KEY": Fernet.generate_key().decode(),
        "COLUMNS": "200",
        "MY_KEY_VAR": OTHER,
    }
    runner = Cli(env)
    yield runner
    for output in runner.outputs:
        assert SENTINEL not in output and OTHER not in output
        assert "SENTINEL" not in output


def redis_dump(client: redis.Redis) -> bytes:
    """Every key and value of this run's Redis db, concatenated."""
    parts: list[bytes] = []
    for key in client.scan_iter(count=1000):
        parts.append(key)
        kind = client.type(key)
        if kind == b"string":
            parts.append(client.get(key) or b"")
        elif kind == b"hash":
            for k, v in client.hgetall(key).items():
                parts += [k, v]
        elif kind == b"zset":
            parts += [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == b"set":
            parts += list(client.smembers(key))
        elif kind == b"list":
            parts += client.lrange(key, 0, -1)
        else:
            parts.append(repr(client.dump(key)).encode())
    return b"\n".join(parts)


def rows_as_text(engine: Engine) -> str:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT row_to_json(k)::text FROM harvest_api_keys k")).scalars()
        return "\n".join(rows)


def count_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM harvest_api_keys")).scalar_one())


def assert_secret_nowhere(client: redis.Redis, engine: Engine) -> None:
    dump = redis_dump(client)
    stored = rows_as_text(engine)
    for secret in (SENTINEL, OTHER):
        assert secret.encode() not in dump
        assert secret not in stored and secret.encode().hex() not in stored


def test_add_ls_disable_enable_rm(cli: Cli, clean_db: Engine, redis_client: redis.Redis) -> None:
    out = cli.ok("keys", "add", "ai", "main", "--max-concurrency", "3", stdin=SENTINEL + "\n")
    assert "added key ai/main" in out and "sk-…2d4f" in out
    out = cli.ok("keys", "add", "ai", "backup", "--rate", "60/m", "--secret-env", "MY_KEY_VAR")
    assert "added key ai/backup" in out and "sk-…5c6d" in out
    out = cli.ok("keys", "add", "ai", "main", "--secret-stdin", stdin="sk-something-else\n")
    assert "already exists" in out

    pool = KeyPool(redis_client, "ai")
    assert pool.is_loaded()
    assert len(pool.snapshot()) == 2
    assert isinstance(pool.lease("test", 30.0), Lease)  # the pool is live: one lease held

    listing = cli.ok("keys", "ls")
    for expected in ("main", "backup", "sk-…2d4f", "sk-…5c6d", "active", "60/m"):
        assert expected in listing
    assert "/3" in listing and "/1" in listing  # live leases out of max concurrency
    assert "%" in listing

    cli.ok("keys", "disable", "ai", "main")
    assert "disabled" in cli.ok("keys", "ls", "ai")
    with clean_db.connect() as conn:
        main_id = conn.execute(
            text("SELECT id FROM harvest_api_keys WHERE name = 'main'")
        ).scalar_one()
    states = {s.key_id: s for s in pool.snapshot()}
    assert states[main_id].status == "disabled"

    assert "active" in cli.ok("keys", "enable", "ai", "main")
    assert {s.key_id: s for s in pool.snapshot()}[main_id].status == "active"

    assert "removed key ai/main" in cli.ok("keys", "rm", "ai", "main")
    listing = cli.ok("keys", "ls")
    assert "backup" in listing and "sk-…2d4f" not in listing
    assert main_id not in {s.key_id for s in pool.snapshot()}
    assert "no keys in pool 'nope'" in cli.ok("keys", "ls", "nope")

    assert_secret_nowhere(redis_client, clean_db)


def test_enable_ends_a_cooldown_running_in_redis(
    cli: Cli, clean_db: Engine, redis_client: redis.Redis
) -> None:
    cli.ok("keys", "add", "ai", "main", stdin=SENTINEL + "\n")
    pool = KeyPool(redis_client, "ai")
    (state,) = pool.snapshot()
    pool.cooldown(state.key_id, 600.0)  # a 429 with Retry-After: 600
    assert pool.snapshot()[0].status == "cooling"
    assert not isinstance(pool.lease("test", 30.0), Lease)
    assert "active" in cli.ok("keys", "enable", "ai", "main")
    assert pool.snapshot()[0].status == "active"
    assert isinstance(pool.lease("test", 30.0), Lease)  # leased again at once
    cli.ok("keys", "disable", "ai", "main")
    pool.cooldown(state.key_id, 600.0)
    assert "active" in cli.ok("keys", "enable", "ai", "main")  # disabled and cooling: both end
    assert pool.snapshot()[0].status == "active"


def test_ls_shows_a_pool_redis_lost_as_not_loaded(
    cli: Cli, redis_client: redis.Redis, clean_db: Engine
) -> None:
    cli.ok("keys", "add", "ai", "main", stdin=SENTINEL)
    redis_client.delete(*redis_client.keys("harvest:pool:*"))
    assert "not loaded" in cli.ok("keys", "ls")
    assert "1 key(s) loaded" in cli.ok("keys", "sync", "ai")
    assert KeyPool(redis_client, "ai").is_loaded()
    assert_secret_nowhere(redis_client, clean_db)


def test_user_mistakes_are_one_line_and_store_nothing(
    cli: Cli, clean_db: Engine, redis_client: redis.Redis
) -> None:
    line = cli.refused("keys", "disable", "ai", "nope")
    assert line == "error: no API key 'nope' in pool 'ai'"
    assert "no API key" in cli.refused("keys", "enable", "ai", "nope")
    assert "no API key" in cli.refused("keys", "rm", "ai", "nope")

    assert "invalid rate_limit" in cli.refused(
        "keys", "add", "ai", "main", "--rate", "sixty", stdin=SENTINEL
    )
    assert "invalid max_concurrency" in cli.refused(
        "keys", "add", "ai", "main", "--max-concurrency", "0", stdin=SENTINEL
    )
    assert "invalid pool" in cli.refused("keys", "add", "a b", "main", stdin=SENTINEL)
    assert "invalid secret" in cli.refused("keys", "add", "ai", "main", stdin="")
    assert "NOT_SET_VAR" in cli.refused("keys", "add", "ai", "main", "--secret-env", "NOT_SET_VAR")
    # A secret typed on the command line is refused without being echoed.
    assert "command line" in cli.refused("keys", "add", "ai", "main", SENTINEL)
    assert "command line" in cli.refused("keys", "add", "ai", "main", f"--secret={SENTINEL}")

    no_key = {k: v for k, v in cli.env.items() if k != "HARVEST_SECRET_KEY"}
    line = cli.refused("keys", "add", "ai", "main", stdin=SENTINEL, env=no_key)
    assert line == (
        "error: HARVEST_SECRET_KEY is not set: refusing to store an API key secret unencrypted"
    )
    bad_key = cli.env | {"HARVEST_SECRET_KEY": "SENTINEL-not-a-fernet-key"}
    line = cli.refused("keys", "add", "ai", "main", stdin=SENTINEL, env=bad_key)
    assert "HARVEST_SECRET_KEY is not a valid Fernet key" in line

    assert count_rows(clean_db) == 0
    assert not KeyPool(redis_client, "ai").is_loaded()
    assert_secret_nowhere(redis_client, clean_db)


def test_tpm_is_stored_synced_to_redis_and_shown(
    cli: Cli, clean_db: Engine, redis_client: redis.Redis
) -> None:
    cli.ok("keys", "add", "llm", "main", "--rate", "60/m", "--tpm", "90000", stdin=SENTINEL)
    pool = KeyPool(redis_client, "llm")
    state = pool.snapshot()[0]
    assert state.tokens is not None and state.tokens.count == 90000
    listing = cli.ok("keys", "ls", "llm")
    assert "90,000 tpm" in listing and "60/m" in listing
    redis_client.delete(*redis_client.keys("harvest:pool:*"))  # Redis lost it: rebuilt with tpm
    cli.ok("keys", "sync", "llm")
    assert pool.snapshot()[0].tokens == state.tokens
    assert "invalid tpm" in cli.refused("keys", "add", "llm", "b", "--tpm", "0", stdin=SENTINEL)
    assert count_rows(clean_db) == 1
