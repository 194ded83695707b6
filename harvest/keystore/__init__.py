"""Every statement on ``harvest_api_keys``, and the encryption of API key secrets.

Postgres is the source of truth for a pool's keys; Redis holds only their live state
(:class:`harvest.coordination.KeyPool`). Secrets are stored as Fernet tokens made with the master
key ``HARVEST_SECRET_KEY``; only the masked hint (``sk-…abcd``) is ever read back for display.
:func:`secret_for` is the one way to get a secret in clear, meant for a worker right before the
handler runs.

After any key change, :func:`sync_pool` copies the pool into Redis; :func:`ensure_pool_loaded`
rebuilds a pool Redis lost (restart, flush). Both read Postgres and write Redis under one lock
per pool, so a sync from a stale read can never land after a newer one.

The parts, each importing only those listed before it::

    cipher.py      Cipher: the master key, encrypting and decrypting secrets
    values.py      KeyInfo, KeyRef, KeyNotFound and the argument checks
    rows.py        every statement on harvest_api_keys
    last_used.py   LastUsedBuffer: key-use times written behind, one statement per window
    __init__.py    keeping Redis in step (sync_pool, ensure_pool_loaded); the names above
"""

from __future__ import annotations

import logging

from redis import Redis
from sqlalchemy import Engine

from harvest.coordination.key_pool import KeyPool
from harvest.coordination.lock import Lock
from harvest.db import translate_errors
from harvest.errors import KeyNotFound
from harvest.keystore.cipher import NOT_SET, Cipher
from harvest.keystore.last_used import LastUsedBuffer
from harvest.keystore.rows import (
    RATE_GUARD_FRACTION,
    RATE_GUARD_MAX,
    add_key,
    get_key,
    guarded,
    list_keys,
    remove_key,
    secret_for,
    set_status,
    specs_for_pool,
    touch_last_used,
)
from harvest.keystore.values import (
    MAX_CONCURRENCY,
    MAX_SECRET_CHARS,
    MAX_TPM,
    KeyInfo,
    KeyRef,
    check_max_concurrency,
    check_name,
    check_rate,
    check_secret,
    check_tpm,
)

__all__ = [
    "MAX_CONCURRENCY",
    "MAX_SECRET_CHARS",
    "MAX_TPM",
    "NOT_SET",
    "RATE_GUARD_FRACTION",
    "RATE_GUARD_MAX",
    "SYNC_LOCK_TTL",
    "SYNC_LOCK_WAIT",
    "Cipher",
    "KeyInfo",
    "KeyNotFound",
    "KeyRef",
    "LastUsedBuffer",
    "add_key",
    "check_max_concurrency",
    "check_name",
    "check_rate",
    "check_secret",
    "check_tpm",
    "ensure_pool_loaded",
    "get_key",
    "guarded",
    "list_keys",
    "remove_key",
    "secret_for",
    "set_status",
    "specs_for_pool",
    "sync_pool",
    "touch_last_used",
]


log = logging.getLogger(__name__)


SYNC_LOCK_TTL = 30.0
SYNC_LOCK_WAIT = 10.0


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
