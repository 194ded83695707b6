"""A pool key's live state as Redis reports it, how its learned limits move, and the values a
pool is synced with and leases by (KeySpec, Lease, Busy): pure values, shared by
:mod:`harvest.coordination.key_pool` (which re-exports them), the CLI, the dashboard and
metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from harvest.coordination.rate_limit import Rate
from harvest.coordination.scripts import micros, text
from harvest.coordination.scripts import seconds as to_seconds

Status = Literal["active", "cooling", "disabled"]
STATUSES: tuple[str, ...] = get_args(Status)
STATE_FIELDS = 16  # values per key in pool_state.lua's reply


@dataclass(frozen=True)
class Learning:
    """How a key's effective limits move (AIMD). On a 429 with room, each becomes ``beta`` x
    what it was; on each call that succeeds it grows by ``recover`` x the declared limit while
    below the level under the one that failed, and by ``step`` x the declared limit above it."""

    beta: float = 0.5
    recover: float = 0.1
    step: float = 0.001


LEARNING = Learning()


@dataclass(frozen=True)
class Throttled:
    """What a 429 did to a key: cooling until ``until`` (Redis clock); ``lowered``: its effective
    limits were lowered to ``max_concurrency`` and ``rate`` calls a window (0: no rate)."""

    until: float
    lowered: bool
    max_concurrency: int
    rate: int


@dataclass(frozen=True)
class KeyState:
    """One key as Redis sees it right now (for the CLI and metrics)."""

    key_id: int
    status: Status
    live_leases: int
    max_concurrency: int
    cooldown_until: float | None
    rate: Rate | None
    rate_used: int
    tokens: Rate | None = None  # the token budget (None: none)
    tokens_used: int = 0  # tokens in the window now: live reservations and ended calls' use
    effective_max: int = 0  # concurrency admitted by now: max_concurrency, or lower once learned
    effective_rate: int = 0  # calls a rate window admitted by now (0: no rate limit)
    announced_requests: int | None = None  # what the service last said is left, while it runs
    announced_tokens: int | None = None
    lowered: int = 0  # times a 429 with room lowered its limits (since the pool was loaded)

    @property
    def learned(self) -> bool:
        """Its effective limits are below the declared ones."""
        rate = self.rate.count if self.rate is not None else 0
        return self.effective_max < self.max_concurrency or self.effective_rate < rate

    @property
    def learned_text(self) -> str:
        """The limits it admits by where 429s lowered them, and what the service said is left
        (for ``harvest keys ls`` and the dashboard)."""
        parts = []
        if self.effective_max < self.max_concurrency:
            parts.append(f"C {self.effective_max}/{self.max_concurrency}")
        if self.rate is not None and self.effective_rate < self.rate.count:
            parts.append(f"R {self.effective_rate}/{self.rate.count}")
        if self.announced_requests is not None:
            parts.append(f"{self.announced_requests:,} req left")
        if self.announced_tokens is not None:
            parts.append(f"{self.announced_tokens:,} tok left")
        return ", ".join(parts) or "as declared"

    @property
    def announced_out(self) -> bool:
        """The service said nothing is left until its reset."""
        return self.announced_requests == 0 or self.announced_tokens == 0

    @property
    def tokens_full(self) -> bool:
        """Its token window holds its whole budget: no call with a cost fits until it slides."""
        return self.tokens is not None and self.tokens_used >= self.tokens.count

    @property
    def available(self) -> int:
        """Leases this key could grant right now: min(free concurrency, rate permits left);
        none while its token window is full."""
        if self.status != "active" or self.tokens_full or self.announced_out:
            return 0
        free = self.effective_max - self.live_leases
        if self.rate is not None:
            free = min(free, self.effective_rate - self.rate_used)
        if self.announced_requests is not None:
            free = min(free, self.announced_requests)
        return max(free, 0)

    @property
    def serving(self) -> bool:
        """Active, with rate permits left in its window: it can take calls now or as soon as
        a lease frees."""
        if self.status != "active" or self.tokens_full or self.announced_out:
            return False
        return self.rate is None or self.rate_used < self.effective_rate

    @classmethod
    def from_reply(cls, row: Sequence[Any]) -> KeyState:
        key_id, status, live, mc, cool, rate_n, rate_us, used, tpm, tpm_us, spent = row[:11]
        eff_max, eff_rate, ann_req, ann_tok, lowered = (int(v) for v in row[11:16])
        rate = Rate(int(rate_n), to_seconds(int(rate_us))) if int(rate_n) > 0 else None
        cooldown = to_seconds(int(cool)) if int(cool) else None
        return cls(
            int(key_id), _status(status), int(live), int(mc), cooldown, rate, int(used),
            Rate(int(tpm), to_seconds(int(tpm_us))) if int(tpm) > 0 else None, int(spent),
            eff_max, eff_rate, None if ann_req < 0 else ann_req, None if ann_tok < 0 else ann_tok,
            lowered,
        )  # fmt: skip


def _status(value: bytes | str) -> Status:
    status = text(value)
    for known in get_args(Status):
        if status == known:
            return cast(Status, known)
    raise ValueError(f"unexpected key status in Redis: {status!r}")


@dataclass(frozen=True)
class KeySpec:
    """One key's limits and status, as Postgres knows them."""

    key_id: int
    max_concurrency: int
    rate: Rate | None = None
    status: Status = "active"
    cooldown_until: float | None = None  # seconds since the epoch
    tokens: Rate | None = None  # token budget: ``count`` tokens per ``period`` (None: no budget)

    def __post_init__(self) -> None:
        if isinstance(self.key_id, bool) or not isinstance(self.key_id, int) or self.key_id < 0:
            raise ValueError(f"invalid key_id {self.key_id!r}: must be an integer >= 0")
        mc = self.max_concurrency
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
            raise ValueError(f"key {self.key_id}: invalid max_concurrency {mc!r}: must be >= 1")
        if self.status not in STATUSES:
            raise ValueError(f"key {self.key_id}: invalid status {self.status!r}: use {STATUSES}")
        if self.status == "cooling" and self.cooldown_until is None:
            raise ValueError(f"key {self.key_id}: status 'cooling' needs cooldown_until")
        if self.rate is not None and not isinstance(self.rate, Rate):
            raise ValueError(f"key {self.key_id}: invalid rate {self.rate!r}: use parse_rate()")
        if self.tokens is not None and not isinstance(self.tokens, Rate):
            raise ValueError(f"key {self.key_id}: invalid token budget {self.tokens!r}: use Rate")

    def as_args(self) -> list[str | int]:
        """The eight values ``pool_sync.lua`` takes per key."""
        rate, tokens = self.rate, self.tokens
        cool = micros(self.cooldown_until) if self.cooldown_until is not None else 0
        return [
            str(self.key_id),
            self.max_concurrency,
            rate.count if rate else 0,
            rate.period_micros if rate else 0,
            self.status,
            cool,
            tokens.count if tokens else 0,
            tokens.period_micros if tokens else 0,
        ]


@dataclass(frozen=True)
class Lease:
    """A key held by one holder until ``expires_at``, granted at ``granted_at`` (seconds since
    the epoch, both on the Redis clock: the time the key's rate window counted this grant at)."""

    pool: str
    key_id: int
    token: str
    fence: int
    expires_at: float
    cost: int = 0  # tokens reserved on the key (settled at release with what the call used)
    granted_at: float = 0.0
    plain: bool = False  # at its grant the key had no rate, token budget, learned limit or
    # announcement: only its concurrency bounds it (see SyncShell.release_then_lease)


@dataclass(frozen=True)
class Busy:
    """No key could be leased now; one could be in about ``retry_after`` seconds (``never``: the
    call's token cost is above every key's budget, no wait helps)."""

    retry_after: float
    never: bool = False


MAX_COST = 10**12


def check_ttl(ttl: float) -> None:
    """A lease's time to live: more than 0 seconds."""
    if not ttl > 0:
        raise ValueError(f"invalid ttl {ttl!r}: must be > 0 seconds")


def check_cost(value: object, what: str = "cost") -> int:
    """A whole number of tokens, 0..10^12 (0: none)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COST:
        raise ValueError(f"invalid {what} {value!r}: must be a whole number of tokens >= 0")
    return value
