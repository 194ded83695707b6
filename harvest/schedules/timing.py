"""The pure part of schedules: limits, misfire policies, the fire times of a cron expression
or an interval (:func:`plan`), and the checks at the door."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from harvest import validation
from harvest.errors import InvalidOption, InvalidSchedule

TASK = "harvest.schedules"  # routed to the schedule queue by harvest.broker
MIN_EVERY = 1.0  # seconds: the schedules task ticks once a second
MAX_EVERY = validation.MAX_DELAY
MAX_CATCH_UP = 1000
MAX_FIRES_PER_TICK = 1000  # bounds one schedule's work in one tick, whatever the policy
MAX_NAME = 200
MAX_SCHEDULES_PER_TICK = 500
MAX_TICK_SECONDS = 2.0


class Misfire(enum.StrEnum):
    SKIP = "skip"
    RUN_ONCE = "run_once"
    CATCH_UP = "catch_up"


# --- timing (pure) -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """When a schedule fires: a cron expression in ``timezone``, or every ``every`` seconds."""

    cron: str | None = None
    every: float | None = None
    timezone: str = "UTC"

    @property
    def step(self) -> timedelta:
        assert self.every is not None
        return timedelta(microseconds=round(self.every * 1_000_000))

    def first(self, now: datetime, start_at: datetime | None = None) -> datetime:
        """The first fire time of a new (or resumed, or re-timed) schedule: the first cron time
        after ``now`` (or at/after ``start_at``); for an interval, ``start_at``, else one interval
        from ``now`` (on a whole second when the interval is whole seconds)."""
        if self.cron is not None:
            after = max(now, start_at - timedelta(microseconds=1)) if start_at else now
            return self._cron_next(after)
        if start_at is not None:
            return start_at
        base = now + self.step
        if self.step % timedelta(seconds=1) == timedelta(0):
            base = base.replace(microsecond=0) + timedelta(seconds=1 if base.microsecond else 0)
        return base

    def after(self, anchor: datetime, now: datetime) -> datetime:
        """The first fire time strictly after ``now``, on the grid of ``anchor`` (a fire time)."""
        if self.cron is not None:
            return self._cron_next(now)
        step = self.step
        if now < anchor:
            return anchor
        return anchor + ((now - anchor) // step + 1) * step

    def due(self, anchor: datetime, now: datetime) -> Iterator[datetime]:
        """Fire times from ``anchor`` (a fire time) up to ``now``, latest first."""
        if now < anchor:
            return
        if self.cron is not None:
            it = croniter(self.cron, (now + timedelta(microseconds=1)).astimezone(self.zone))
            while (t := it.get_prev(datetime).astimezone(UTC)) >= anchor:
                yield t
            return
        step = self.step
        k = (now - anchor) // step
        while k >= 0:
            yield anchor + k * step
            k -= 1

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def _cron_next(self, after: datetime) -> datetime:
        assert self.cron is not None
        value: datetime = croniter(self.cron, after.astimezone(self.zone)).get_next(datetime)
        return value.astimezone(UTC)

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        return f"every {self.every:g}s"


@dataclass(frozen=True, slots=True)
class Plan:
    fires: list[datetime]  # ascending
    next_run_at: datetime


def plan(
    timing: Timing,
    next_run_at: datetime,
    now: datetime,
    *,
    misfire: Misfire,
    catch_up: int = 1,
    grace: float,
) -> Plan:
    """Which due fire times one tick runs, and the schedule's next fire time (strictly after
    ``now``). Pure: the database's ``now`` is passed in."""
    missed_before = now - timedelta(seconds=grace)
    limit = min(catch_up, MAX_FIRES_PER_TICK) if misfire is Misfire.CATCH_UP else MAX_FIRES_PER_TICK
    fires: list[datetime] = []
    for t in timing.due(next_run_at, now):
        if misfire is Misfire.CATCH_UP or t >= missed_before:
            fires.append(t)
        else:
            if misfire is Misfire.RUN_ONCE:
                fires.append(t)
            break
        if len(fires) >= limit:
            break
    return Plan(sorted(fires), timing.after(next_run_at, now))


# --- checks at the door ------------------------------------------------------------------------


def check_name(name: Any) -> str:
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= MAX_NAME
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise InvalidSchedule(
            "name", f"must be 1-{MAX_NAME} printable characters, got {name!r:.80}"
        )
    return name


def check_timing(cron: Any, every: Any, timezone: Any) -> Timing:
    zone = check_timezone(timezone)
    if (cron is None) == (every is None):
        raise InvalidSchedule(
            "cron", "give exactly one of cron=... (an expression) or every=... (seconds)"
        )
    if cron is not None:
        if not isinstance(cron, str) or "\x00" in cron or not croniter.is_valid(cron):
            raise InvalidSchedule(
                "cron",
                f"{validation.shown(cron)} is not a cron expression "
                "(e.g. '*/5 * * * *', '@hourly')",
            )
        return Timing(cron=cron.strip(), timezone=zone)
    if isinstance(every, timedelta):
        every = every.total_seconds()
    if isinstance(every, bool) or not isinstance(every, int | float) or not math.isfinite(every):
        raise InvalidSchedule(
            "every", f"must be seconds or a timedelta, got {validation.shown(every)}"
        )
    if not MIN_EVERY <= every <= MAX_EVERY:
        raise InvalidSchedule(
            "every", f"must be from {MIN_EVERY:g} s to ten years, got {validation.shown(every)}"
        )
    return Timing(every=float(every), timezone=zone)


def check_timezone(timezone: Any) -> str:
    if not isinstance(timezone, str) or not timezone or "\x00" in timezone:
        raise InvalidSchedule(
            "timezone",
            f"must be an IANA name like 'Europe/Paris', got {validation.shown(timezone)}",
        )
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidSchedule(
            "timezone",
            f"unknown timezone {validation.shown(timezone)} (an IANA name like 'Europe/Paris')",
        ) from None
    return timezone


def check_misfire(misfire: Any, catch_up: Any) -> tuple[Misfire, int]:
    try:
        policy = Misfire(misfire)
    except ValueError:
        raise InvalidSchedule(
            "misfire",
            f"must be one of {', '.join(m.value for m in Misfire)}, "
            f"got {validation.shown(misfire)}",
        ) from None
    if isinstance(catch_up, bool) or not isinstance(catch_up, int):
        raise InvalidSchedule("catch_up", f"must be an integer, got {validation.shown(catch_up)}")
    if not 1 <= catch_up <= MAX_CATCH_UP:
        raise InvalidSchedule("catch_up", f"must be from 1 to {MAX_CATCH_UP}, got {catch_up}")
    return policy, catch_up


def check_start_at(start_at: Any) -> datetime | None:
    try:
        return validation.check_run_at(start_at)
    except InvalidOption as exc:
        raise InvalidSchedule("start_at", str(exc).removeprefix("invalid run_at: ")) from None
