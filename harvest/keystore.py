"""Every statement on ``harvest_api_keys``, and the encryption of API key secrets.

Postgres is the source of truth for a pool's keys; Redis holds only their live state
(:class:`harvest.coordination.KeyPool`). Secrets are stored as Fernet tokens made with the master
key ``HARVEST_SECRET_KEY``; only the masked hint (``sk-…abcd``) is ever read back for display.
:func:`secret_for` is the one way to get a secret in clear, meant for a worker right before the
handler runs.

After any key change, :func:`sync_pool` copies the pool into Redis; :func:`ensure_pool_loaded`
rebuilds a pool Redis lost (restart, flush). Both read Postgres and write Redis under one lock
per pool, so a sync from a stale read can never land after a newer one.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from cryptography.fernet import Fernet, InvalidToken
from redis import Redis
from sqlalchemy import Connection, Engine, RowMapping, text
from sqlalchemy.orm import Session

from harvest.coordination import keys
from harvest.coordination.key_pool import STATUSES, KeyPool, KeySpec, Status
from harvest.coordination.lock import Lock
from harvest.coordination.rate_limit import Rate, parse_rate
from harvest.db import get_or_create, translate_errors
from harvest.errors import ConfigurationError, HarvestError, InvalidKey
from harvest.models import ApiKeyRow
from harvest.redact import mask_secret
from harvest.settings import Settings

log = logging.getLogger(__name__)

KeyRef = int | tuple[str, str]
"""A key by id, or by ``(pool, name)``."""

MAX_CONCURRENCY = 10_000
MAX_SECRET_CHARS = 16_384
SYNC_LOCK_TTL = 30.0
SYNC_LOCK_WAIT = 10.0
NOT_SET = "HARVEST_SECRET_KEY is not set: refusing to store an API key secret unencrypted"

_FERNET_KEY = re.compile(r"^[A-Za-z0-9_-]{43}=$")
_NAME_RULE = "use 1-200 characters from letters, digits and _.:/@=+-"


class KeyNotFound(HarvestError, LookupError):
    """No API key matches the id or (pool, name) given."""

    def __init__(self, key: KeyRef) -> None:
        self.key = key
        if isinstance(key, tuple):
            super().__init__(f"no API key {key[1]!r} in pool {key[0]!r}")
        else:
            super().__init__(f"no API key with id {key}")


# --- encryption -----------------------------------------------------------------------------


class Cipher:
    """Encrypts and decrypts API key secrets with the master key (Fernet: AES + HMAC).

    Made without a key, it refuses to encrypt or decrypt (:class:`ConfigurationError`).
    """

    def __init__(self, fernet: Fernet | None) -> None:
        self._fernet = fernet

    @classmethod
    def from_settings(cls, settings: Settings) -> Cipher:
        """The cipher of ``settings.secret_key`` (``HARVEST_SECRET_KEY``); an empty or unset key
        gives a cipher that refuses to store secrets.

        :raises ConfigurationError: the key is not a Fernet key (its value is never echoed).
        """
        raw = settings.secret_key.get_secret_value().strip() if settings.secret_key else ""
        return cls(Fernet(_check_master_key(raw)) if raw else None)

    @property
    def has_key(self) -> bool:
        """True when a master key is configured."""
        return self._fernet is not None

    def encrypt(self, secret: str) -> bytes:
        """The Fernet token of ``secret``.

        :raises ConfigurationError: no master key is configured.
        """
        if self._fernet is None:
            raise ConfigurationError(NOT_SET)
        return self._fernet.encrypt(secret.encode("utf-8"))

    def decrypt(self, token: bytes, *, key_id: int | None = None) -> str:
        """The secret in clear.

        :raises ConfigurationError: no master key, or not the one the secret was stored with.
        """
        if self._fernet is None:
            raise ConfigurationError("HARVEST_SECRET_KEY is not set: cannot decrypt an API key")
        try:
            return self._fernet.decrypt(bytes(token)).decode("utf-8")
        except InvalidToken:
            which = f"API key {key_id}" if key_id is not None else "an API key"
            raise ConfigurationError(
                f"HARVEST_SECRET_KEY cannot decrypt the secret of {which}: "
                "it was stored under another master key"
            ) from None

    def __repr__(self) -> str:
        return f"Cipher(key={'set' if self.has_key else 'not set'})"


def _check_master_key(raw: str) -> bytes:
    """``raw`` as Fernet key bytes: 32 bytes in url-safe base64 (44 characters)."""
    if _FERNET_KEY.match(raw):
        try:
            if len(base64.urlsafe_b64decode(raw)) == 32:
                return raw.encode("ascii")
        except (binascii.Error, ValueError):
            pass
    raise ConfigurationError(
        "HARVEST_SECRET_KEY is not a valid Fernet key: expected 32 bytes in url-safe base64 "
        "(44 characters), as made by cryptography's `Fernet.generate_key()`"
    )


# --- values ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """An API key as anyone but a worker may see it: never the secret, only its hint."""

    id: int
    pool: str
    name: str
    hint: str
    max_concurrency: int
    rate_limit: str | None
    status: Status
    cooldown_until: datetime | None
    last_used_at: datetime | None

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> KeyInfo:
        """From a row of ``_COLUMNS``."""
        return cls(
            id=int(row["id"]),
            pool=row["pool"],
            name=row["name"],
            hint=row["hint"],
            max_concurrency=int(row["max_concurrency"]),
            rate_limit=row["rate_limit"],
            status=_status(row["status"]),
            cooldown_until=row["cooldown_until"],
            last_used_at=row["last_used_at"],
        )

    @classmethod
    def from_model(cls, row: ApiKeyRow) -> KeyInfo:
        """From an ORM row (as get_or_create returns it)."""
        return cls(
            id=row.id,
            pool=row.pool,
            name=row.name,
            hint=row.secret_hint,
            max_concurrency=row.max_concurrency,
            rate_limit=row.rate_limit,
            status=_status(row.status),
            cooldown_until=row.cooldown_until,
            last_used_at=row.last_used_at,
        )


def _status(value: str) -> Status:
    if value not in STATUSES:
        raise ValueError(f"unexpected API key status in Postgres: {value!r}")
    return cast(Status, value)


# --- validation -----------------------------------------------------------------------------


def _shown(value: object) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 60 else text_[:57] + "..."


def check_name(field: str, value: object) -> str:
    """A pool or key name, or :class:`InvalidKey` naming ``field``."""
    try:
        return keys.check_name(field, cast(str, value))
    except ValueError:
        raise InvalidKey(field, f"{_shown(value)}: {_NAME_RULE}") from None


def check_max_concurrency(value: object) -> int:
    """An integer 1..10000, or :class:`InvalidKey`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise InvalidKey("max_concurrency", f"{_shown(value)}: must be 1..{MAX_CONCURRENCY}")
    return value


def check_rate(value: object) -> str | None:
    """A rate such as ``"60/m"`` (stored without spaces), None for no limit, or InvalidKey."""
    if value is None:
        return None
    try:
        parse_rate(cast(str, value))
    except ValueError:
        raise InvalidKey(
            "rate_limit",
            f"{_shown(value)} is not a rate such as '60/m', '5/s', '1000/h' or '10/2s'",
        ) from None
    return "".join(cast(str, value).split())


def check_secret(value: object) -> str:
    """A usable secret, or :class:`InvalidKey` (whose message never contains the secret)."""
    if not isinstance(value, str):
        raise InvalidKey("secret", f"must be a string, not {type(value).__name__}")
    if not value.strip():
        raise InvalidKey("secret", "is empty")
    if value != value.strip():
        raise InvalidKey("secret", "has leading or trailing whitespace")
    if len(value) > MAX_SECRET_CHARS:
        raise InvalidKey("secret", f"is longer than {MAX_SECRET_CHARS} characters")
    return value


# --- adding ---------------------------------------------------------------------------------


def add_key(
    session: Session,
    cipher: Cipher,
    *,
    pool: str,
    name: str,
    secret: str,
    max_concurrency: int = 1,
    rate_limit: str | None = None,
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
    :returns: ``(key, created)``; ``created`` is False when the name was taken.
    :raises InvalidKey: an argument is wrong (``field`` names it); nothing was stored.
    :raises ConfigurationError: no master key to encrypt with; nothing was stored.
    """
    lookup = {"pool": check_name("pool", pool), "name": check_name("name", name)}
    defaults: dict[str, Any] = {
        "max_concurrency": check_max_concurrency(max_concurrency),
        "rate_limit": check_rate(rate_limit),
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
    "cooldown_until, last_used_at"
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
    SELECT id, max_concurrency, rate_limit, status, cooldown_until
    FROM harvest_api_keys WHERE pool = :pool ORDER BY id
    """
)


def specs_for_pool(conn: Connection, pool: str) -> list[KeySpec]:
    """The pool's keys as :class:`KeySpec` values, to load into Redis with ``KeyPool.sync``."""
    return [_spec(r) for r in conn.execute(_SPECS, {"pool": pool}).mappings()]


# The service counts a key's calls by its own clock, on arrival: a call admitted exactly one
# period after another can arrive a little sooner than that. So a key's rate is enforced over a
# window slightly longer than declared: 20 % of the period, at most one second.
RATE_GUARD_FRACTION = 0.2
RATE_GUARD_MAX = 1.0


def guarded(rate: Rate) -> Rate:
    """The window harvest enforces for a declared key rate (see RATE_GUARD_FRACTION)."""
    guard = min(rate.period_seconds * RATE_GUARD_FRACTION, RATE_GUARD_MAX)
    return Rate(rate.count, rate.period_seconds + guard)


def _spec(row: RowMapping) -> KeySpec:
    cooldown = row["cooldown_until"]
    status = _status(row["status"])
    if status == "cooling" and cooldown is None:
        status = "active"  # a cooldown with no end cannot be honoured; set_status never writes one
    return KeySpec(
        key_id=int(row["id"]),
        max_concurrency=int(row["max_concurrency"]),
        rate=guarded(parse_rate(row["rate_limit"])) if row["rate_limit"] else None,
        status=status,
        cooldown_until=cooldown.timestamp() if cooldown is not None else None,
    )


# --- changing -------------------------------------------------------------------------------


def _where(key: KeyRef) -> tuple[str, dict[str, Any]]:
    if isinstance(key, tuple):
        pool, name = key
        return "pool = :pool AND name = :name", {"pool": pool, "name": name}
    if isinstance(key, bool) or not isinstance(key, int):
        raise InvalidKey("key", f"{_shown(key)}: give a key id or a (pool, name) pair")
    return "id = :id", {"id": key}


def _check_status(status: str, cooldown_until: datetime | None) -> None:
    if status not in STATUSES:
        raise InvalidKey("status", f"{_shown(status)}: use one of {', '.join(STATUSES)}")
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


class LastUsedBuffer:
    """Collects key-use times in memory and writes them in one statement per window, instead of
    one UPDATE per call. Thread-safe; keeps at most one time per key (the latest)."""

    def __init__(
        self,
        flush_every: float = 5.0,
        *,
        max_pending: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        :param flush_every: seconds between writes.
        :param max_pending: a flush is due at once when this many keys wait.
        :param clock: monotonic seconds (tests pass their own).
        """
        if not flush_every > 0:
            raise ValueError(f"invalid flush_every {flush_every!r}: must be > 0 seconds")
        if max_pending < 1:
            raise ValueError(f"invalid max_pending {max_pending!r}: must be >= 1")
        self.flush_every = flush_every
        self.max_pending = max_pending
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[int, datetime] = {}
        self._last_flush = clock()

    def record(self, key_id: int, at: datetime | None = None) -> None:
        """Note that ``key_id`` was used at ``at`` (default: now, UTC)."""
        with self._lock:
            self._merge_locked({key_id: at or datetime.now(UTC)})

    def pending(self) -> int:
        """How many keys wait to be written."""
        with self._lock:
            return len(self._pending)

    def due(self) -> bool:
        """True when there is something to write and the window has passed (or it is full)."""
        with self._lock:
            return self._due_locked()

    def flush(self, engine: Engine, *, force: bool = False) -> int:
        """Write the pending times in one statement if due (or ``force``). Returns how many keys
        were written. When the write fails the times are kept for the next flush."""
        with self._lock:
            if not self._pending or not (force or self._due_locked()):
                return 0
            batch, self._pending = self._pending, {}
            self._last_flush = self._clock()
        try:
            with translate_errors(), engine.begin() as conn:
                return touch_last_used(conn, batch)
        except Exception:
            with self._lock:
                self._merge_locked(batch)
            raise

    def _due_locked(self) -> bool:
        if not self._pending:
            return False
        full = len(self._pending) >= self.max_pending
        return full or self._clock() - self._last_flush >= self.flush_every

    def _merge_locked(self, times: Mapping[int, datetime]) -> None:
        for key_id, at in times.items():
            known = self._pending.get(key_id)
            self._pending[key_id] = at if known is None or at > known else known


# --- keeping Redis in step ------------------------------------------------------------------


def _sync_lock(redis: Redis, pool: str) -> Lock:
    return Lock(redis, f"keypool-sync:{pool}", SYNC_LOCK_TTL, blocking_timeout=SYNC_LOCK_WAIT)


def _load(engine: Engine, key_pool: KeyPool) -> int:
    with translate_errors(), engine.connect() as conn:
        specs = specs_for_pool(conn, key_pool.pool)
    key_pool.sync(specs)
    return len(specs)


def sync_pool(engine: Engine, redis: Redis, pool: str) -> int:
    """Make Redis hold exactly the pool's keys as Postgres has them now (after any key change:
    add, disable, enable, remove). Live leases of kept keys survive. Returns the key count.

    :raises InvalidKey: a bad pool name.
    :raises LockNotAcquired: another sync of this pool held its lock for the whole wait.
    """
    key_pool = KeyPool(redis, check_name("pool", pool))
    with _sync_lock(redis, pool):
        return _load(engine, key_pool)


def ensure_pool_loaded(engine: Engine, redis: Redis, pool: str) -> bool:
    """Rebuild the pool in Redis from Postgres when Redis lost it (restart, flush).

    Cheap when loaded (one GET). Returns True when this call rebuilt it.

    :raises InvalidKey: a bad pool name.
    :raises LockNotAcquired: another sync of this pool held its lock for the whole wait.
    """
    key_pool = KeyPool(redis, check_name("pool", pool))
    if key_pool.is_loaded():
        return False
    with _sync_lock(redis, pool):
        if key_pool.is_loaded():  # another process rebuilt it while we waited
            return False
        _load(engine, key_pool)
        log.warning("key pool %r was rebuilt from Postgres (Redis had lost it)", pool)
        return True
