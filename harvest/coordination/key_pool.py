"""The Redis side of an API-key pool: who holds which key, and how fast each key is used.

Keys and their secrets live in Postgres; :meth:`KeyPool.sync` copies each key's limits and
status into Redis. A lease is taken in one Lua script that purges expired leases, skips keys that
are disabled, cooling down, at their concurrency, at their rate limit or (for a call that declares
its cost in tokens) without room in their token budget, and takes the lease, one rate permit and
the token reservation together; the release settles the reservation with what the call used.
Leases expire on the Redis clock, so a dead holder's key comes back by itself within its TTL; no
sweeper is needed for correctness (a dead holder's token reservation stays until its window
passes it).

Limits learned from the service: a 429 on a key whose declared limits had room lowers its
effective concurrency and rate (multiplicative decrease, :data:`LEARNING`), and calls that succeed
grow them back (additive increase), never above what was declared; the rate-limit headers a
handler reports (``ctx.observe``) become the key's announced state, which the lease script admits
by until its reset. All of it in the same scripts, on the Redis clock; it lives in Redis only (a
pool rebuilt after Redis lost it starts again from the declared limits).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from harvest.coordination import keys
from harvest.coordination.key_state import (
    LEARNING,
    STATE_FIELDS,
    STATUSES,
    Busy,
    KeySpec,
    KeyState,
    Learning,
    Lease,
    Status,
    Throttled,
    check_cost,
    check_ttl,
)
from harvest.coordination.scripts import (
    AsyncLuaScript,
    Call,
    LuaScript,
    Script,
    apipelined,
    first_error_raised,
    micros,
    pipelined,
)
from harvest.coordination.scripts import seconds as to_seconds
from harvest.errors import NoKeyAvailable, PoolNotLoaded
from harvest.service_limits import NOTHING, Announced

__all__ = [
    "LEARNING", "STATUSES", "AsyncKeyPool", "Busy", "KeyPool", "KeySpec", "KeyState", "Learning",
    "Lease", "Status", "Throttled", "check_cost",
]  # fmt: skip

MAX_BATCH = 1000
Release = tuple[Lease, "int | None", bool, "Announced | None"]  # lease, used, succeeded, said
S = TypeVar("S", bound=Script)  # a pool's scripts: blocking or asyncio
IDLE_RETRY = 1.0  # retry hint when no key can free up by time alone (none, or all disabled)
_POLL_MAX = 0.25


class _PoolShape(Generic[S]):
    """What a pool's scripts are called with, and how their replies read: shared by the
    blocking :class:`KeyPool` and the asyncio :class:`AsyncKeyPool`, which differ only in I/O."""

    _lease: S
    _release: S
    _heartbeat: S

    def __init__(self, pool: str) -> None:
        self.pool = keys.check_name("pool", pool)
        self._prefix = keys.pool_prefix(pool)
        self._epoch = keys.pool_epoch(pool)
        self._members = keys.pool_members(pool)
        self._wanted, self._freed = keys.pool_wanted(pool), keys.pool_freed(pool)
        self._names: dict[int, tuple[str, str, str]] = {}

    def _lease_call(
        self, holders: Sequence[str], ttl: float, cost: int = 0, prefer: int = 0
    ) -> tuple[list[str], list[Any], list[str]]:
        """(keys, args, tokens) of ``pool_lease.lua``: a lease of ``cost`` tokens for each of
        ``holders``; ``prefer``: the key a release in the same pipeline freed (a hand-off),
        tried first."""
        check_ttl(ttl)
        if not 1 <= len(holders) <= MAX_BATCH:
            raise ValueError(f"invalid lease count {len(holders)}: must be 1..{MAX_BATCH}")
        check_cost(cost)
        tokens = [f"{secrets.token_hex(8)}:{holder}" for holder in holders]
        script_keys = [
            self._epoch,
            self._members,
            keys.pool_cursor(self.pool),
            keys.pool_fence(self.pool),
        ]
        args = [self._prefix, micros(ttl), cost, prefer, keys.WANTED_MS, *tokens]
        return script_keys, args, tokens

    def _each_from(
        self, reply: list[Any], tokens: list[str], args: list[Any], cost: int = 0
    ) -> list[Lease | Busy]:
        """For each token in order: its lease, or (once the keys admit no more) the pool's Busy."""
        granted = int(reply[0])
        if granted < 0:
            raise PoolNotLoaded(self.pool)
        retry_us = int(reply[1])
        busy = Busy(IDLE_RETRY if retry_us < 0 else to_seconds(retry_us), retry_us == -2)
        rows, ttl_us = [int(v) for v in reply[2:]], int(args[1])
        each = zip(rows[0::4], rows[1::4], rows[2::4], rows[3::4], strict=True)
        leases: list[Lease | Busy] = [  # each: key, fence, expiry, plain
            Lease(self.pool, k, tok, fence, to_seconds(end), cost, to_seconds(end - ttl_us), p == 1)
            for tok, (k, fence, end, p) in zip(tokens, each, strict=False)
        ]
        return leases + [busy] * (len(tokens) - len(leases))

    def _leases_from(
        self, reply: list[Any], tokens: list[str], args: list[Any], cost: int = 0
    ) -> list[Lease] | Busy:
        each = self._each_from(reply, tokens, args, cost)
        leases = [x for x in each if isinstance(x, Lease)]
        return leases or next(x for x in each if isinstance(x, Busy))

    def _leases_key(self, lease: Lease) -> str:
        return self._key_names(lease)[0]

    def _key_names(self, lease: Lease) -> tuple[str, str, str]:
        """The leases, tokens and config keys of ``lease``'s key (built once a key)."""
        if lease.pool != self.pool:
            raise ValueError(f"lease of pool {lease.pool!r} given to pool {self.pool!r}")
        pool, k = self.pool, lease.key_id
        if k not in self._names:
            self._names[k] = (keys.pool_key_leases(pool, k), keys.pool_key_tokens(pool, k),
                              keys.pool_key_config(pool, k))  # fmt: skip
        return self._names[k]

    def _release_call(
        self, lease: Lease, used: int | None, succeeded: bool = False,
        announced: Announced | None = None, *, wake: bool = True,
    ) -> tuple[list[str], list[Any]]:  # fmt: skip
        """(keys, args) of ``pool_release.lua``: free ``lease``, settle its reservation, grow
        the key's learned limits back when the call ``succeeded``, keep what it ``announced``;
        ``wake`` one waiting process while the pool is wanted (:meth:`KeyPool.await_freed`;
        not when the same pipeline leases the slot freed)."""
        if used is not None:
            check_cost(used, "used tokens")
        script_keys = [*self._key_names(lease), self._wanted, self._freed]
        learn = [1 if succeeded else 0, LEARNING.recover, LEARNING.step]
        said = announced.as_args() if announced is not None else NOTHING
        return script_keys, [
            lease.token, lease.fence, lease.cost, -1 if used is None else used, *learn, *said,
            keys.WANTED_MS if wake else 0,
        ]  # fmt: skip

    def _handoff(
        self, lease: Lease, holder: str, ttl: float, *, used: int | None, succeeded: bool,
        announced: Announced | None, cost: int,
    ) -> tuple[list[Call], Callable[[list[Any]], tuple[bool, Lease | Busy]]]:  # fmt: skip
        """The two scripts of ``release_then_lease`` (the release of ``lease`` first, so the
        lease for ``holder`` may take the slot it frees), and how their replies read."""
        released = self._release_call(lease, used, succeeded, announced, wake=False)
        script_keys, args, tokens = self._lease_call([holder], ttl, cost, prefer=lease.key_id)

        def read(replies: list[Any]) -> tuple[bool, Lease | Busy]:
            freed, reply = first_error_raised(replies)
            return bool(int(freed)), self._each_from(reply, tokens, args, cost)[0]

        return [(self._release, *released), (self._lease, script_keys, args)], read

    def _heartbeat_calls(self, leases: Sequence[Lease], ttl: float) -> list[Call]:
        check_ttl(ttl)
        until = micros(ttl)
        return [(self._heartbeat, [self._leases_key(x)], [x.token, until]) for x in leases]

    def _throttle_call(
        self, lease: Lease, seconds: float, exhausted: bool
    ) -> tuple[list[str], list[Any]]:
        """(keys, args) of ``pool_key_admin.lua`` throttle: a 429 on ``lease``."""
        if not seconds > 0:
            raise ValueError(f"invalid cooldown {seconds!r}: must be > 0 seconds")
        script_keys, args = self._admin_call(lease.key_id, "throttle", micros(seconds))
        script_keys += [
            keys.pool_fence(self.pool),
            self._leases_key(lease),
            keys.pool_key_rate(self.pool, lease.key_id),
            keys.pool_key_tokens(self.pool, lease.key_id),
        ]
        return script_keys, [*args, lease.fence, LEARNING.beta, 1 if exhausted else 0]

    @staticmethod
    def _throttled(reply: Any) -> Throttled | None:
        if not isinstance(reply, list):
            return None  # the key is not in the pool
        until, lowered, max_concurrency, rate = (int(v) for v in reply)
        return Throttled(to_seconds(until), bool(lowered), max_concurrency, rate)

    def _admin_call(self, key_id: int, action: str, arg: int = 0) -> tuple[list[str], list[Any]]:
        config = keys.pool_key_config(self.pool, key_id)
        return [self._members, config], [str(int(key_id)), action, arg]


class KeyPool(_PoolShape[LuaScript]):
    """The live state of one named pool of API keys, shared by every worker through Redis."""

    def __init__(self, redis: Redis, pool: str) -> None:
        """
        :param redis: the coordination Redis client.
        :param pool: the pool's name (letters, digits and ``_.:/@=+-``).
        """
        super().__init__(pool)
        self._redis = redis
        self._sync = LuaScript(redis, "pool_sync")
        self._lease = LuaScript(redis, "pool_lease")
        self._heartbeat = LuaScript(redis, "pool_heartbeat")
        self._release = LuaScript(redis, "pool_release")
        self._admin = LuaScript(redis, "pool_key_admin")
        self._state = LuaScript(redis, "pool_state")

    # --- loading ------------------------------------------------------------------------------

    def sync(self, specs: Sequence[KeySpec]) -> None:
        """Make the pool hold exactly ``specs``; live leases of kept keys survive.

        Keys not listed are removed with their leases. A cooldown running in Redis is never
        shortened by a sync (a fresh 429 outlives a stale copy of the key's status).
        """
        args: list[str | int] = [self._prefix]
        seen: set[int] = set()
        for spec in specs:
            if not isinstance(spec, KeySpec):
                raise ValueError(f"pool {self.pool!r}: sync takes KeySpec values, got {spec!r}")
            if spec.key_id in seen:
                raise ValueError(f"pool {self.pool!r}: key_id {spec.key_id} is listed twice")
            seen.add(spec.key_id)
            args.extend(spec.as_args())
        self._sync.integer([self._epoch, self._members], args)

    def epoch(self) -> int | None:
        """The pool's sync counter; None when Redis holds no pool (never synced, or lost)."""
        value = self._redis.get(self._epoch)
        return None if value is None else int(value)

    def is_loaded(self) -> bool:
        """False when Redis lost the pool (restart, flush): call :meth:`sync` again."""
        return self.epoch() is not None

    # --- leasing ------------------------------------------------------------------------------

    def lease(self, holder: str, ttl: float, *, cost: int = 0) -> Lease | Busy:
        """Lease the least loaded usable key now, or say how long to wait.

        :param holder: who holds it (part of the token, for debugging).
        :param ttl: seconds until the lease expires unless heartbeated.
        :param cost: tokens the call will use, reserved on the key's token budget (0: none).
        :raises PoolNotLoaded: Redis holds no state for this pool.
        """
        result = self.lease_many(holder, ttl, 1, cost=cost)
        return result if isinstance(result, Busy) else result[0]

    def lease_many(self, holder: str, ttl: float, n: int, *, cost: int = 0) -> list[Lease] | Busy:
        """Lease up to ``n`` keys (spread over keys, least loaded first) in one script, each
        reserving ``cost`` tokens.

        Returns the leases granted (maybe fewer than ``n``), or :class:`Busy` when none was.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BATCH:
            raise ValueError(f"invalid lease count {n!r}: must be 1..{MAX_BATCH}")
        script_keys, args, tokens = self._lease_call([holder] * n, ttl, cost)
        return self._leases_from(self._lease.array(script_keys, args), tokens, args, cost)

    def release_then_lease(
        self,
        lease: Lease,
        holder: str,
        ttl: float,
        *,
        used: int | None = None,
        succeeded: bool = False,
        announced: Announced | None = None,
        cost: int = 0,
    ) -> tuple[bool, Lease | Busy]:
        """:meth:`release` of ``lease``, then :meth:`lease` for ``holder``, in one round trip:
        the two scripts pipelined, each atomic as alone, the release first (so the lease may
        take the slot it freed). Returns (the release's answer, the lease's).

        :raises PoolNotLoaded: Redis holds no state for this pool (the release was done).
        """
        calls, read = self._handoff(
            lease, holder, ttl, used=used, succeeded=succeeded, announced=announced, cost=cost
        )
        return read(pipelined(self._redis, calls))

    def acquire(self, holder: str, ttl: float, *, timeout: float, cost: int = 0) -> Lease:
        """Lease a key, waiting up to ``timeout`` seconds.

        :raises NoKeyAvailable: no key was free in time (carries the pool's retry estimate).
        """
        deadline = time.monotonic() + timeout
        while isinstance(result := self.lease(holder, ttl, cost=cost), Busy):
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoKeyAvailable(self.pool, result.retry_after)
            time.sleep(min(result.retry_after, _POLL_MAX, left))
        return result

    @contextmanager
    def leased(
        self, holder: str, ttl: float, *, timeout: float = 0.0, raise_on_failure: bool = True
    ) -> Iterator[Lease | None]:
        """Hold a lease for the ``with`` block and release it after.

        With ``raise_on_failure=False`` yields None instead of raising :class:`NoKeyAvailable`.
        """
        try:
            lease: Lease | None = self.acquire(holder, ttl, timeout=timeout)
        except NoKeyAvailable:
            if raise_on_failure:
                raise
            lease = None
        try:
            yield lease
        finally:
            if lease is not None:
                self.release(lease)

    def heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend ``lease`` to ``ttl`` seconds from now; False when it was lost (expired,
        reclaimed, or its key left the pool): stop using the key."""
        return self.heartbeat_until(lease, ttl) is not None

    def heartbeat_until(self, lease: Lease, ttl: float) -> float | None:
        """Like :meth:`heartbeat`, returning the new expiry (Redis clock) or None when lost."""
        check_ttl(ttl)
        until = self._heartbeat.integer([self._leases_key(lease)], [lease.token, micros(ttl)])
        return to_seconds(until) if until else None

    def release(
        self,
        lease: Lease,
        *,
        used: int | None = None,
        succeeded: bool = False,
        announced: Announced | None = None,
    ) -> bool:
        """Free ``lease``; False when it was already lost (reported, never raised).

        :param used: tokens the call used: its reservation becomes that (more is charged; less
            is refunded, unless the lease was lost). None: the reservation stands as charged.
        :param succeeded: the call succeeded: a key whose limits were lowered grows them back.
        :param announced: what the service's rate-limit headers said is left (the key admits
            by it until its reset).
        """
        call = self._release_call(lease, used, succeeded, announced)
        return bool(self._release.integer(*call))

    def throttle(
        self, lease: Lease, seconds: float, *, exhausted: bool = False
    ) -> Throttled | None:
        """The call made with ``lease`` got a 429: rest its key ``seconds``, and lower its
        effective limits when its declared ones had room (see :class:`Learning`).

        :param exhausted: the 429's own headers said nothing was left (no lowering then).
        :returns: what was done, or None when the key is not in the pool.
        """
        return self._throttled(self._admin(*self._throttle_call(lease, seconds, exhausted)))

    def await_freed(self, seconds: float) -> bool:
        """Block up to ``seconds`` for a key given back while the pool is wanted (a lease try
        found none: ``pool_release.lua``); True when this process was the one woken for it."""
        return self._redis.blpop([self._freed], timeout=seconds) is not None

    def heartbeat_many(self, leases: Sequence[Lease], ttl: float) -> list[bool]:
        """Extend many leases in one round trip (a pipeline); False for each one lost."""
        beats = pipelined(self._redis, self._heartbeat_calls(leases, ttl))
        return [bool(int(v)) for v in first_error_raised(beats)]

    # --- key status ---------------------------------------------------------------------------

    def cooldown(self, key_id: int, seconds: float) -> float | None:
        """Rest a key for ``seconds`` (a 429 / Retry-After); it comes back by itself.

        A running longer cooldown is kept. Returns when the cooldown ends (seconds since the
        epoch, Redis clock), or None when the key is not in the pool.
        """
        if not seconds > 0:
            raise ValueError(f"invalid cooldown {seconds!r}: must be > 0 seconds")
        until = self._key_action(key_id, "cooldown", micros(seconds))
        return to_seconds(until) if until else None

    def disable(self, key_id: int) -> bool:
        """Stop leasing a key (live leases run out); False when the key is not in the pool."""
        return bool(self._key_action(key_id, "disable"))

    def enable(self, key_id: int) -> bool:
        """Undo :meth:`disable` (a running cooldown still holds); False when not in the pool."""
        return bool(self._key_action(key_id, "enable"))

    def end_cooldown(self, key_id: int) -> bool:
        """End a running cooldown now (an operator's say-so; a disabled key stays disabled);
        False when the key is not in the pool."""
        return bool(self._key_action(key_id, "uncool"))

    def _key_action(self, key_id: int, action: str, arg: int = 0) -> int:
        return self._admin.integer(*self._admin_call(key_id, action, arg))

    # --- reading ------------------------------------------------------------------------------

    def snapshot(self) -> list[KeyState]:
        """Every key's live state, read in one consistent view.

        :raises PoolNotLoaded: Redis holds no state for this pool.
        """
        reply = self._state.array([self._epoch, self._members], [self._prefix])
        if int(reply[0]) < 0:
            raise PoolNotLoaded(self.pool)
        rows = reply[2:]
        n = STATE_FIELDS
        return [KeyState.from_reply(rows[i : i + n]) for i in range(0, len(rows), n)]

    def capacity(self) -> int:
        """How many leases could be granted right now across the pool."""
        return sum(state.available for state in self.snapshot())


class AsyncKeyPool(_PoolShape[AsyncLuaScript]):
    """:class:`KeyPool`'s hot path for an asyncio client: the same scripts, awaited."""

    def __init__(self, redis: AsyncRedis, pool: str) -> None:
        super().__init__(pool)
        self._redis = redis
        self._lease = AsyncLuaScript(redis, "pool_lease")
        self._heartbeat = AsyncLuaScript(redis, "pool_heartbeat")
        self._release = AsyncLuaScript(redis, "pool_release")
        self._admin = AsyncLuaScript(redis, "pool_key_admin")

    async def lease(self, holder: str, ttl: float, *, cost: int = 0) -> Lease | Busy:
        """See :meth:`KeyPool.lease`. :raises PoolNotLoaded: Redis holds no such pool."""
        return (await self.lease_each([holder], ttl, cost=cost))[0]

    async def lease_each(
        self, holders: Sequence[str], ttl: float, *, cost: int = 0
    ) -> list[Lease | Busy]:
        """A lease for each of ``holders``, in one script (spread over the keys, least loaded
        first, in the holders' order): the first get leases while keys admit them, the rest
        the pool's Busy. :raises PoolNotLoaded: Redis holds no such pool."""
        script_keys, args, tokens = self._lease_call(holders, ttl, cost)
        return self._each_from(await self._lease.array(script_keys, args), tokens, args, cost)

    async def heartbeat_many(self, leases: Sequence[Lease], ttl: float) -> list[bool]:
        """See :meth:`KeyPool.heartbeat_many`."""
        beats = await apipelined(self._redis, self._heartbeat_calls(leases, ttl))
        return [bool(int(v)) for v in first_error_raised(beats)]

    async def release_then_lease(
        self, lease: Lease, holder: str, ttl: float, *, used: int | None = None,
        succeeded: bool = False, announced: Announced | None = None, cost: int = 0,
    ) -> tuple[bool, Lease | Busy]:  # fmt: skip
        """See :meth:`KeyPool.release_then_lease`."""
        calls, read = self._handoff(
            lease, holder, ttl, used=used, succeeded=succeeded, announced=announced, cost=cost
        )
        return read(await apipelined(self._redis, calls))

    async def release_each(self, releases: Sequence[Release]) -> list[bool]:
        """:meth:`KeyPool.release` of each (lease, used, succeeded, announced), in one round
        trip (the scripts pipelined, each atomic as alone)."""
        calls = [(self._release, *self._release_call(*release)) for release in releases]
        return [bool(int(v)) for v in first_error_raised(await apipelined(self._redis, calls))]

    async def await_freed(self, seconds: float) -> bool:
        """See :meth:`KeyPool.await_freed`."""
        return await self._redis.blpop([self._freed], timeout=seconds) is not None

    async def throttle(
        self, lease: Lease, seconds: float, *, exhausted: bool = False
    ) -> Throttled | None:
        """See :meth:`KeyPool.throttle`."""
        call = self._throttle_call(lease, seconds, exhausted)
        return self._throttled(await self._admin(*call))

    async def cooldown(self, key_id: int, seconds: float) -> float | None:
        """See :meth:`KeyPool.cooldown`."""
        if not seconds > 0:
            raise ValueError(f"invalid cooldown {seconds!r}: must be > 0 seconds")
        until = await self._admin.integer(*self._admin_call(key_id, "cooldown", micros(seconds)))
        return to_seconds(until) if until else None

    async def disable(self, key_id: int) -> bool:
        """See :meth:`KeyPool.disable`."""
        return bool(await self._admin.integer(*self._admin_call(key_id, "disable")))
