"""Every Redis key name harvest uses for coordination is built here (nowhere else).

Names carry a ``{hash tag}`` so that all keys of one primitive (one pool, one lock, one
semaphore, one limiter) live in the same Redis Cluster slot and one script may touch them all.

Two scripts touch per-API-key structures whose names depend on data (``lease.lua``,
``pool_sync.lua`` and friends): they receive :func:`pool_prefix` and append the suffixes below,
so :func:`pool_key_config`, :func:`pool_key_leases`, :func:`pool_key_rate` and
:func:`pool_key_tokens` must stay in step with ``KEY_CONFIG``, ``KEY_LEASES``, ``KEY_RATE`` and
``KEY_TOKENS`` (the Lua files use the same literals).
"""

from __future__ import annotations

import re

PREFIX = "harvest:"

KEY_CONFIG = "key:"
KEY_LEASES = "leases:"
KEY_RATE = "rate:"
KEY_TOKENS = "tokens:"

_NAME = re.compile(r"^[A-Za-z0-9_.:/@=+-]{1,200}$")


def check_name(kind: str, name: str) -> str:
    """Refuse a name that could break key layout (braces, spaces, empty, very long)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use 1-200 characters from letters, digits and _.:/@=+-"
        )
    return name


# --- rate limiter ---------------------------------------------------------------------------


def rate_window(name: str) -> str:
    """ZSET of admitted calls (member unique per call, score = Redis time in microseconds)."""
    return f"{PREFIX}rate:{{{check_name('rate limit', name)}}}"


# --- semaphore ------------------------------------------------------------------------------


def _sem(name: str, part: str) -> str:
    return f"{PREFIX}sem:{{{check_name('semaphore', name)}}}:{part}"


def semaphore_owners(name: str) -> str:
    """ZSET token -> ticket (the INCR counter value when the permit was taken)."""
    return _sem(name, "owners")


def semaphore_timeouts(name: str) -> str:
    """ZSET token -> expiry (Redis time, microseconds) of each held permit."""
    return _sem(name, "timeouts")


def semaphore_counter(name: str) -> str:
    """STRING counter: tickets for holders and waiters (fair ordering, fencing)."""
    return _sem(name, "counter")


def semaphore_waiters(name: str) -> str:
    """ZSET token -> ticket of blocked acquirers, served first-come first-served."""
    return _sem(name, "waiters")


def semaphore_waiter_timeouts(name: str) -> str:
    """ZSET token -> expiry of each waiter's place in line (a dead waiter loses its place)."""
    return _sem(name, "waiter_timeouts")


# --- lock and leader election ---------------------------------------------------------------


def lock(name: str) -> str:
    """STRING holding the owner's token, with a PX expiry."""
    return f"{PREFIX}lock:{{{check_name('lock', name)}}}"


def lock_fence(name: str) -> str:
    """STRING counter, INCR on every acquisition: the fencing number of the current owner."""
    return f"{PREFIX}lock:{{{check_name('lock', name)}}}:fence"


def leader_lock_name(name: str) -> str:
    """The lock name a leader election for ``name`` is built on."""
    return f"leader:{check_name('leader election', name)}"


# --- API-key pool ---------------------------------------------------------------------------


def pool_prefix(pool: str) -> str:
    """Common prefix of every key of one pool (scripts append the per-API-key suffixes)."""
    return f"{PREFIX}pool:{{{check_name('pool', pool)}}}:"


def pool_epoch(pool: str) -> str:
    """STRING counter bumped by every sync; its absence means Redis lost (or never had) the pool."""
    return pool_prefix(pool) + "epoch"


def pool_members(pool: str) -> str:
    """ZSET key_id -> key_id: the pool's keys in a stable order (round-robin walks it)."""
    return pool_prefix(pool) + "keys"


def pool_cursor(pool: str) -> str:
    """STRING counter: rotating start point for round-robin tie breaking."""
    return pool_prefix(pool) + "cursor"


def pool_fence(pool: str) -> str:
    """STRING counter, INCR on every lease: fencing numbers, increasing across the pool."""
    return pool_prefix(pool) + "fence"


def pool_wanted(pool: str) -> str:
    """STRING set for :data:`WANTED_MS` by every lease try that found no key for a call: some
    process may have jobs waiting for a key of the pool."""
    return pool_prefix(pool) + "wanted"


def pool_freed(pool: str) -> str:
    """LIST of key ids, pushed by a release while the pool is wanted and popped (BLPOP) by a
    process whose jobs wait for a key: a key freed in one process wakes a waiter in another
    at once, not at its next poll. Short-lived (:data:`WANTED_MS`), at most 64 entries."""
    return pool_prefix(pool) + "freed"


WANTED_MS = 1000  # how long a pool stays wanted after a failed try, and freed ids are kept


def pool_key_config(pool: str, key_id: int) -> str:
    """HASH of one key: max, rate_n, rate_us, status, cool_until (microseconds, 0 = none),
    tpm, tpm_us (0 = no token budget)."""
    return f"{pool_prefix(pool)}{KEY_CONFIG}{int(key_id)}"


def pool_key_leases(pool: str, key_id: int) -> str:
    """ZSET token -> expiry (Redis time, microseconds) of one key's leases."""
    return f"{pool_prefix(pool)}{KEY_LEASES}{int(key_id)}"


def pool_key_rate(pool: str, key_id: int) -> str:
    """ZSET fence -> grant time (microseconds): one key's sliding rate window."""
    return f"{pool_prefix(pool)}{KEY_RATE}{int(key_id)}"


def pool_key_tokens(pool: str, key_id: int) -> str:
    """ZSET "<fence>:<tokens>" -> grant time (microseconds): one key's sliding token window
    (a live call's reservation at its declared cost, an ended call at what it used)."""
    return f"{pool_prefix(pool)}{KEY_TOKENS}{int(key_id)}"


# --- dispatch nudges ------------------------------------------------------------------------


def nudge() -> str:
    """``SET NX PX`` marker that coalesces dispatch nudges across all enqueuing processes."""
    return f"{PREFIX}nudge"


def broker_mark() -> str:
    """Marker, kept in the broker's own Redis db with no expiry, that the queues there are the
    ones harvest published to: found missing (a Redis restarted without persistence, or
    flushed), the messages of every dispatched job are gone (harvest.dispatcher.dispatch)."""
    return f"{PREFIX}broker-mark"


def rescue_ran() -> str:
    """``SET PX`` marker of the last rescue (``HARVEST_RESCUE_INTERVAL``): a dispatch tick that
    finds it gone runs one (harvest.dispatcher.rescue_if_due)."""
    return f"{PREFIX}rescue-ran"


# --- worker registry ------------------------------------------------------------------------


def worker_index() -> str:
    """ZSET worker id -> expiry (Redis time, milliseconds) of every live execution process."""
    return f"{PREFIX}workers"


def worker_info(worker_id: str) -> str:
    """HASH of one worker process: what it is, what it can run, what it runs now."""
    return f"{PREFIX}worker:{worker_id}"


# --- dashboard login throttling (harvest.web.throttle) ----------------------------------------
# One hash tag for all of them: one script reads an address's and a user's keys together.
# Addresses and user names are hashed: no user name (or password typed in its place) is stored.

LOGIN_PREFIX = f"{PREFIX}{{web-login}}:"


def login_address_failures(address_hash: str) -> str:
    """STRING counter of failed logins from one client address (expires after a quiet window)."""
    return f"{LOGIN_PREFIX}fails:addr:{address_hash}"


def login_address_lock(address_hash: str) -> str:
    """STRING with a PX expiry: while it exists, logins from the address are refused (429)."""
    return f"{LOGIN_PREFIX}lock:addr:{address_hash}"


def login_user_failures(user_hash: str) -> str:
    """STRING counter of failed logins for one user name, from any address."""
    return f"{LOGIN_PREFIX}fails:user:{user_hash}"


def login_known(user_hash: str, address_hash: str) -> str:
    """STRING with an expiry: the user logged in from this address (not slowed by user alerts)."""
    return f"{LOGIN_PREFIX}known:{user_hash}:{address_hash}"
