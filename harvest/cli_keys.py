"""``harvest keys add|ls|disable|enable|rm|sync``: secrets in Postgres (encrypted), the live
pool in Redis. Registered in :mod:`harvest.cli`."""

from __future__ import annotations

import contextlib
import getpass
import os
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from harvest.cli_common import _first_line, _Lazy, _settings, out
from harvest.cli_tables import Column, fit, when
from harvest.errors import ConfigurationError, InvalidKey, PoolNotLoaded, ServiceUnavailable

if TYPE_CHECKING:
    import redis
    from sqlalchemy import Connection, Engine

    from harvest import keystore
    from harvest.coordination.key_pool import KeyState
    from harvest.settings import Settings
else:
    redis = _Lazy("redis")
    keystore = _Lazy("harvest.keystore")

keys_cli = typer.Typer(help="API keys: secrets encrypted in Postgres, live leases in Redis.")


# --- keys -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _key_services(settings: Settings) -> Iterator[tuple[Engine, redis.Redis]]:
    """A one-connection engine and a Redis client, closed after; driver errors become one
    clear line (ServiceUnavailable)."""
    from harvest.db import make_engine, translate_errors

    engine = make_engine(settings, pool_size=1)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        with translate_errors():
            yield engine, client
    except redis.RedisError as exc:
        raise ServiceUnavailable("Redis", _first_line(exc)) from None
    finally:
        client.close()
        engine.dispose()


def _sync_pool(engine: Engine, client: redis.Redis, pool: str) -> None:
    """Bring the live pool in Redis in step with Postgres after a key change."""
    try:
        keystore.sync_pool(engine, client, pool)
    except redis.RedisError as exc:
        raise ServiceUnavailable(
            "Redis",
            f"{_first_line(exc)}; the change is saved in Postgres: "
            f"run `harvest keys sync {pool}` once Redis answers",
        ) from None


def _read_secret(secret_env: str | None, secret_stdin: bool) -> str:
    """The secret from the environment variable named, else stdin (never from argv)."""
    if secret_env is not None:
        if secret_stdin:
            raise InvalidKey("secret", "give --secret-stdin or --secret-env, not both")
        value = os.environ.get(secret_env)
        if value is None:
            raise InvalidKey("secret", f"environment variable {secret_env!r} is not set")
        return value.strip()
    if sys.stdin.isatty():
        return getpass.getpass("API key secret (not echoed): ").strip()
    value = sys.stdin.read(4 * keystore.MAX_SECRET_CHARS).strip()
    if not value:
        raise InvalidKey("secret", "nothing on stdin (pipe the secret in, or use --secret-env VAR)")
    return value


@keys_cli.command(
    "add", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def keys_add(
    ctx: typer.Context,
    pool: Annotated[str, typer.Argument(help="The pool's name.")],
    name: Annotated[str, typer.Argument(help="The key's name within the pool.")],
    *,
    max_concurrency: Annotated[
        int, typer.Option(help="Leases the key may have at once (1..10000).")
    ] = 1,
    rate: Annotated[
        str | None, typer.Option(help="Calls allowed per period: 60/m, 5/s, 1000/h, 10/2s.")
    ] = None,
    tpm: Annotated[
        int | None, typer.Option(help="Tokens allowed per minute (jobs declare a cost).")
    ] = None,
    secret_stdin: Annotated[
        bool, typer.Option("--secret-stdin", help="Read the secret from stdin (the default).")
    ] = False,
    secret_env: Annotated[
        str | None,
        typer.Option("--secret-env", metavar="VAR", help="Read the secret from this variable."),
    ] = None,
) -> None:
    """Add an API key to POOL; its secret is read from stdin or --secret-env.

    The secret is never taken from the command line, and is stored encrypted with
    HARVEST_SECRET_KEY; only its masked form (sk-…abcd) is ever shown."""
    if ctx.args:  # never echo them: a secret typed on the command line would be printed
        raise InvalidKey(
            "secret", "never give it on the command line: pipe it on stdin or use --secret-env VAR"
        )
    settings = _settings()
    cipher = keystore.Cipher.from_settings(settings)
    if not cipher.has_key:
        raise ConfigurationError(keystore.NOT_SET)
    secret = _read_secret(secret_env, secret_stdin)
    from sqlalchemy.orm import Session

    with _key_services(settings) as (engine, client):
        with Session(engine) as session, session.begin():
            info, created = keystore.add_key(
                session, cipher, pool=pool, name=name, secret=secret,
                max_concurrency=max_concurrency, rate_limit=rate, tpm=tpm,
            )  # fmt: skip
        _sync_pool(engine, client, info.pool)
    where = f"{info.pool}/{info.name} (id {info.id}, {info.hint})"
    if created:
        out.print(f"added key {where}", markup=False)
    else:
        out.print(
            f"key {where} already exists: left unchanged (rm it first to replace it)",
            markup=False,
        )


@keys_cli.command("ls")
def keys_ls(pool: Annotated[str | None, typer.Argument(help="Only this pool.")] = None) -> None:
    """List API keys (secrets masked), with their live leases when the pool is loaded."""
    with _key_services(_settings()) as (engine, client):
        with engine.connect() as conn:
            rows = keystore.list_keys(conn, pool)
        live = {p: _live_state(client, p) for p in sorted({r.pool for r in rows})}
    if not rows:
        out.print(f"no keys in pool {pool!r}" if pool else "no keys", markup=False)
        return
    out.print(_keys_table(rows, live))


def _live_state(client: redis.Redis, pool: str) -> dict[int, KeyState] | None:
    """The pool's keys as Redis sees them now; None when the pool is not loaded."""
    from harvest.coordination.key_pool import KeyPool

    try:
        return {s.key_id: s for s in KeyPool(client, pool).snapshot()}
    except PoolNotLoaded:
        return None


_KEY_COLUMNS = (
    Column("pool"), Column("name"), Column("secret"), Column("status"),
    Column("max conc.", 120), Column("rate"), Column("learned", 110), Column("leases"),
    Column("use", 100), Column("cooldown until", 120), Column("last used", 100),
)  # fmt: skip


def _keys_table(rows: list[keystore.KeyInfo], live: dict[str, dict[int, KeyState] | None]) -> Table:
    cells = []
    for key in rows:
        states = live.get(key.pool)
        state = states.get(key.id) if states is not None else None
        cells.append((
            key.pool, key.name, key.hint, _key_status(key, state), str(key.max_concurrency),
            _key_rate(key, state), state.learned_text if state else "-", *_key_use(states, state),
            _key_cooldown(key, state, out.width), when(key.last_used_at, out.width),
        ))  # fmt: skip
    return fit(_KEY_COLUMNS, cells, width=out.width, title="API keys")


def _key_rate(key: keystore.KeyInfo, state: KeyState | None) -> str:
    """The declared rate, and the token budget with the tokens in its window now."""
    if key.tpm is None:
        return key.rate_limit or "-"
    used = f" ({state.tokens_used:,} in window)" if state is not None else ""
    return ", ".join(filter(None, [key.rate_limit, f"{key.tpm:,} tpm{used}"]))


def _key_status(key: keystore.KeyInfo, state: KeyState | None) -> str:
    if state is None or state.status == key.status:
        return key.status
    return f"{key.status} (live: {state.status})"


def _key_use(states: dict[int, KeyState] | None, state: KeyState | None) -> tuple[str, str]:
    if states is None:
        return "not loaded", "-"
    if state is None:
        return "not synced", "-"
    return f"{state.live_leases}/{state.max_concurrency}", (
        f"{state.live_leases / state.max_concurrency:.0%}"
    )


def _key_cooldown(key: keystore.KeyInfo, state: KeyState | None, width: int) -> str:
    until = key.cooldown_until
    if state is not None and state.cooldown_until is not None:
        live = datetime.fromtimestamp(state.cooldown_until, UTC)
        until = max(until, live) if until is not None else live
    return when(until, width)


def _change_key(
    pool: str, name: str, change: Callable[[Connection, keystore.KeyRef], keystore.KeyInfo]
) -> keystore.KeyInfo:
    """Apply one key change in Postgres, commit, then sync the pool in Redis."""
    with _key_services(_settings()) as (engine, client):
        with engine.begin() as conn:
            info = change(conn, (pool, name))
        _sync_pool(engine, client, pool)
    return info


@keys_cli.command("disable")
def keys_disable(pool: str, name: str) -> None:
    """Stop leasing a key (leases held now run out)."""
    info = _change_key(pool, name, lambda c, k: keystore.set_status(c, k, "disabled"))
    out.print(f"key {info.pool}/{info.name}: disabled", markup=False)


@keys_cli.command("enable")
def keys_enable(pool: str, name: str) -> None:
    """Lease a key again, now: undoes a disable and ends a running cooldown."""
    from harvest.coordination.key_pool import KeyPool

    with _key_services(_settings()) as (engine, client):
        with engine.begin() as conn:
            info = keystore.set_status(conn, (pool, name), "active")
        _sync_pool(engine, client, pool)
        KeyPool(client, pool).end_cooldown(info.id)
    out.print(f"key {info.pool}/{info.name}: active", markup=False)


@keys_cli.command("rm")
def keys_rm(pool: str, name: str) -> None:
    """Delete a key and its secret; leases held now are dropped."""
    info = _change_key(pool, name, keystore.remove_key)
    out.print(f"removed key {info.pool}/{info.name} (id {info.id}, {info.hint})", markup=False)


@keys_cli.command("sync")
def keys_sync(pool: str) -> None:
    """Copy POOL's keys from Postgres into Redis.

    Every key change does it; run it after an outage or a change made with SQL."""
    with _key_services(_settings()) as (engine, client):
        count = keystore.sync_pool(engine, client, pool)
    out.print(f"pool {pool}: {count} key(s) loaded", markup=False)
