"""Every statement on ``harvest_api_keys``: adding a key, reading keys (and, for a worker, a
secret), the pool's keys as :class:`KeySpec` values for Redis, changing a key's status,
removing it, and recording when keys were last used."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, RowMapping, text
from sqlalchemy.orm import Session

from harvest.coordination.key_pool import STATUSES, KeySpec
from harvest.coordination.rate_limit import Rate, parse_rate
from harvest.db import get_or_create
from harvest.errors import InvalidKey, KeyNotFound
from harvest.keystore.cipher import Cipher
from harvest.keystore.values import (
    KeyInfo,
    KeyRef,
    check_max_concurrency,
    check_name,
    check_rate,
    check_secret,
    check_tpm,
    key_status,
    shown,
)
from harvest.models import ApiKeyRow
from harvest.redact import mask_secret


def add_key(
    session: Session,
    cipher: Cipher,
    *,
    pool: str,
    name: str,
    secret: str,
    max_concurrency: int = 1,
    rate_limit: str | None = None,
    tpm: int | None = None,
) -> tuple[KeyInfo, bool]:
    """Add a key to ``pool``, or find the one already named ``name`` there (left unchanged).

    Race-safe under any number of concurrent callers (get-or-create on ``(pool, name)``). Every
    argument is checked before anything is written; the caller commits the session.

    :param session: the session to write in (its transaction is the caller's).
    :param cipher: encrypts the secret (:meth:`Cipher.from_settings`).
    :param pool: the pool's name (letters, digits and ``_.:/@=+-``, at most 200).
    :param name: the key's name within the pool (same rule).
    :param secret: the API key itself; stored only encrypted.
    :param max_concurrency: leases the key may have at once, 1..10000.
    :param rate_limit: calls allowed per period (``"60/m"``), or None for no limit.
    :param tpm: tokens allowed per minute (reserved by jobs that declare a ``cost``), or None.
    :returns: ``(key, created)``; ``created`` is False when the name was taken.
    :raises InvalidKey: an argument is wrong (``field`` names it); nothing was stored.
    :raises ConfigurationError: no master key to encrypt with; nothing was stored.
    """
    lookup = {"pool": check_name("pool", pool), "name": check_name("name", name)}
    defaults: dict[str, Any] = {
        "max_concurrency": check_max_concurrency(max_concurrency),
        "rate_limit": check_rate(rate_limit),
        "tpm": check_tpm(tpm),
        "secret_hint": mask_secret(check_secret(secret)),
        "secret_encrypted": cipher.encrypt(secret),
        "status": "active",
        "cooldown_until": None,
        "last_used_at": None,
    }
    row, created = get_or_create(session, ApiKeyRow, lookup=lookup, defaults=defaults)
    return KeyInfo.from_model(row), created


# --- reading --------------------------------------------------------------------------------

_COLUMNS = (
    "id, pool, name, secret_hint AS hint, max_concurrency, rate_limit, status, "
    "cooldown_until, last_used_at, tpm"
)


def list_keys(conn: Connection, pool: str | None = None) -> list[KeyInfo]:
    """Every key (of ``pool`` when given), by pool then name. Never the secrets."""
    where, params = ("WHERE pool = :pool", {"pool": pool}) if pool is not None else ("", {})
    sql = text(f"SELECT {_COLUMNS} FROM harvest_api_keys {where} ORDER BY pool, name")
    return [KeyInfo.from_row(r) for r in conn.execute(sql, params).mappings()]


def get_key(conn: Connection, key: KeyRef) -> KeyInfo:
    """One key, by id or ``(pool, name)``.

    :raises KeyNotFound: no such key.
    """
    where, params = _where(key)
    row = (
        conn.execute(text(f"SELECT {_COLUMNS} FROM harvest_api_keys WHERE {where}"), params)
        .mappings()
        .one_or_none()
    )
    if row is None:
        raise KeyNotFound(key)
    return KeyInfo.from_row(row)


_SECRET = text("SELECT secret_encrypted FROM harvest_api_keys WHERE id = :id")


def secret_for(conn: Connection, cipher: Cipher, key_id: int) -> str:
    """The secret of key ``key_id`` in clear. Only for a worker, right before the handler runs;
    never log, print or return it from a status call.

    :raises KeyNotFound: the key was removed.
    :raises ConfigurationError: no master key, or not the one the secret was stored with.
    """
    token = conn.execute(_SECRET, {"id": key_id}).scalar_one_or_none()
    if token is None:
        raise KeyNotFound(key_id)
    return cipher.decrypt(token, key_id=key_id)


_SPECS = text(
    """
    SELECT id, max_concurrency, rate_limit, status, cooldown_until, tpm
    FROM harvest_api_keys WHERE pool = :pool ORDER BY id
    """
)


def specs_for_pool(conn: Connection, pool: str) -> list[KeySpec]:
    """The pool's keys as :class:`KeySpec` values, to load into Redis with ``KeyPool.sync``."""
    return [_spec(r) for r in conn.execute(_SPECS, {"pool": pool}).mappings()]


# The service counts a key's calls by its own clock, on arrival: a call admitted exactly one
# period after another can arrive a little sooner than that. So a key's rate is enforced over a
# window slightly longer than declared: 20 % of the period, at most one second. The same goes
# for its token budget (tokens per minute over a window of 61 s).
RATE_GUARD_FRACTION = 0.2
RATE_GUARD_MAX = 1.0


def guarded(rate: Rate) -> Rate:
    """The window harvest enforces for a declared key rate (see RATE_GUARD_FRACTION)."""
    guard = min(rate.period_seconds * RATE_GUARD_FRACTION, RATE_GUARD_MAX)
    return Rate(rate.count, rate.period_seconds + guard)


def _spec(row: RowMapping) -> KeySpec:
    cooldown = row["cooldown_until"]
    status = key_status(row["status"])
    if status == "cooling" and cooldown is None:
        status = "active"  # a cooldown with no end cannot be honoured; set_status never writes one
    return KeySpec(
        key_id=int(row["id"]),
        max_concurrency=int(row["max_concurrency"]),
        rate=guarded(parse_rate(row["rate_limit"])) if row["rate_limit"] else None,
        status=status,
        cooldown_until=cooldown.timestamp() if cooldown is not None else None,
        tokens=guarded(Rate(int(row["tpm"]), 60.0)) if row["tpm"] is not None else None,
    )


# --- changing -------------------------------------------------------------------------------


def _where(key: KeyRef) -> tuple[str, dict[str, Any]]:
    if isinstance(key, tuple):
        pool, name = key
        return "pool = :pool AND name = :name", {"pool": pool, "name": name}
    if isinstance(key, bool) or not isinstance(key, int):
        raise InvalidKey("key", f"{shown(key)}: give a key id or a (pool, name) pair")
    return "id = :id", {"id": key}


def _check_status(status: str, cooldown_until: datetime | None) -> None:
    if status not in STATUSES:
        raise InvalidKey("status", f"{shown(status)}: use one of {', '.join(STATUSES)}")
    if status == "cooling" and cooldown_until is None:
        raise InvalidKey("cooldown_until", "is required when the status is 'cooling'")
    if status != "cooling" and cooldown_until is not None:
        raise InvalidKey("cooldown_until", "is only allowed with the status 'cooling'")
    if cooldown_until is not None and cooldown_until.utcoffset() is None:
        raise InvalidKey("cooldown_until", "must be timezone-aware")


def set_status(
    conn: Connection, key: KeyRef, status: str, cooldown_until: datetime | None = None
) -> KeyInfo:
    """Set a key's status: ``active``, ``disabled``, or ``cooling`` until ``cooldown_until``.

    Call :func:`sync_pool` after the commit so Redis follows.

    :raises InvalidKey: a bad status, or a cooldown end missing, misplaced or naive.
    :raises KeyNotFound: no such key.
    """
    _check_status(status, cooldown_until)
    where, params = _where(key)
    sql = text(
        f"UPDATE harvest_api_keys SET status = :status, cooldown_until = :cool, "
        f"updated_at = now() WHERE {where} RETURNING {_COLUMNS}"
    )
    row = conn.execute(sql, {**params, "status": status, "cool": cooldown_until}).mappings()
    found = row.one_or_none()
    if found is None:
        raise KeyNotFound(key)
    return KeyInfo.from_row(found)


def remove_key(conn: Connection, key: KeyRef) -> KeyInfo:
    """Delete a key (its secret with it); returns what it was. Call :func:`sync_pool` after the
    commit: Redis then drops the key and its leases, whose holders' heartbeats fail.

    :raises KeyNotFound: no such key.
    """
    where, params = _where(key)
    sql = text(f"DELETE FROM harvest_api_keys WHERE {where} RETURNING {_COLUMNS}")
    found = conn.execute(sql, params).mappings().one_or_none()
    if found is None:
        raise KeyNotFound(key)
    return KeyInfo.from_row(found)


# Rows are locked in id order (the sorted CTE) so that concurrent flushes from many workers,
# touching overlapping keys, cannot deadlock. last_used_at never moves backwards.
_TOUCH = text(
    """
    WITH used AS (
        SELECT id, max(at) AS at
        FROM unnest(CAST(:ids AS bigint[]), CAST(:ats AS timestamptz[])) AS u(id, at)
        GROUP BY id
    ), locked AS (
        SELECT k.id, used.at FROM harvest_api_keys AS k JOIN used ON used.id = k.id
        ORDER BY k.id
        FOR NO KEY UPDATE OF k
    )
    UPDATE harvest_api_keys AS k SET last_used_at = GREATEST(k.last_used_at, locked.at)
    FROM locked WHERE k.id = locked.id
    """
)


def touch_last_used(conn: Connection, used: Mapping[int, datetime]) -> int:
    """Record when keys were last used, for many keys in one statement (write-behind: see
    :class:`LastUsedBuffer`). Returns how many keys were found."""
    if not used:
        return 0
    params = {"ids": list(used), "ats": list(used.values())}
    return int(conn.execute(_TOUCH, params).rowcount)
