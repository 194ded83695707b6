"""Which fire times a schedules tick runs (pure: no database), and the checks at the door."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harvest.errors import InvalidSchedule
from harvest.schedules import (
    Misfire,
    Timing,
    check_misfire,
    check_name,
    check_timing,
    plan,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
S = timedelta(seconds=1)
EVERY_SECOND = Timing(every=1.0)


def seconds(*offsets: float) -> list[datetime]:
    return [T0 + timedelta(seconds=o) for o in offsets]


def test_on_time_tick_fires_the_due_time_and_moves_to_the_next() -> None:
    p = plan(EVERY_SECOND, T0, T0 + 0.4 * S, misfire=Misfire.SKIP, grace=15)
    assert p.fires == [T0]
    assert p.next_run_at == T0 + S


def test_a_late_tick_within_grace_fires_every_due_time_under_any_policy() -> None:
    for policy in Misfire:
        p = plan(EVERY_SECOND, T0, T0 + 3.5 * S, misfire=policy, catch_up=10, grace=15)
        assert p.fires == seconds(0, 1, 2, 3), policy
        assert p.next_run_at == T0 + 4 * S


def test_skip_drops_missed_fire_times() -> None:
    now = T0 + timedelta(minutes=10, milliseconds=500)
    p = plan(EVERY_SECOND, T0, now, misfire=Misfire.SKIP, grace=3)
    assert p.fires == seconds(598, 599, 600)  # no more than 3 s before now
    assert p.next_run_at == T0 + 601 * S


def test_run_once_adds_one_job_for_all_missed() -> None:
    now = T0 + timedelta(minutes=10, milliseconds=500)
    p = plan(EVERY_SECOND, T0, now, misfire=Misfire.RUN_ONCE, grace=3)
    assert p.fires == seconds(597, 598, 599, 600)  # 597: the latest missed, standing for all


def test_run_once_with_nothing_on_time_runs_exactly_one() -> None:
    hourly = Timing(every=3600.0)
    now = T0 + timedelta(hours=5, minutes=30)
    p = plan(hourly, T0, now, misfire=Misfire.RUN_ONCE, grace=15)
    assert p.fires == [T0 + timedelta(hours=5)]
    assert p.next_run_at == T0 + timedelta(hours=6)
    assert plan(hourly, T0, now, misfire=Misfire.SKIP, grace=15).fires == []


def test_catch_up_runs_at_most_n_of_the_latest() -> None:
    hourly = Timing(every=3600.0)
    now = T0 + timedelta(hours=5, minutes=30)
    p = plan(hourly, T0, now, misfire=Misfire.CATCH_UP, catch_up=3, grace=15)
    assert p.fires == [T0 + timedelta(hours=h) for h in (3, 4, 5)]
    p = plan(hourly, T0, now, misfire=Misfire.CATCH_UP, catch_up=100, grace=15)
    assert p.fires == [T0 + timedelta(hours=h) for h in range(6)]


def test_not_due_yet_fires_nothing() -> None:
    p = plan(EVERY_SECOND, T0, T0 - 0.2 * S, misfire=Misfire.CATCH_UP, catch_up=5, grace=15)
    assert p.fires == []
    assert p.next_run_at == T0


def test_cron_fire_times_walk_back_from_now() -> None:
    every5 = Timing(cron="*/5 * * * *")
    now = T0 + timedelta(minutes=17)
    p = plan(every5, T0, now, misfire=Misfire.CATCH_UP, catch_up=10, grace=15)
    assert p.fires == [T0 + timedelta(minutes=m) for m in (0, 5, 10, 15)]
    assert p.next_run_at == T0 + timedelta(minutes=20)


def test_cron_follows_its_timezone_across_daylight_saving() -> None:
    nine_in_paris = Timing(cron="0 9 * * *", timezone="Europe/Paris")
    winter = nine_in_paris.first(datetime(2026, 3, 27, 12, tzinfo=UTC))
    assert winter == datetime(2026, 3, 28, 8, tzinfo=UTC)  # UTC+1
    summer = nine_in_paris.after(winter, winter)
    assert summer == datetime(2026, 3, 29, 7, tzinfo=UTC)  # UTC+2 from 29 March


def test_interval_first_fire_time_is_one_interval_away_on_a_whole_second() -> None:
    now = T0 + timedelta(milliseconds=250)
    assert EVERY_SECOND.first(now) == T0 + 2 * S
    assert Timing(every=60.0).first(T0) == T0 + timedelta(minutes=1)
    assert Timing(every=2.5).first(now) == now + timedelta(seconds=2.5)
    assert EVERY_SECOND.first(now, T0 + timedelta(days=1)) == T0 + timedelta(days=1)


@settings(max_examples=300, deadline=None)
@given(
    every=st.sampled_from([1.0, 1.5, 7.0, 60.0, 3600.0]),
    late=st.floats(min_value=-5, max_value=20_000),
    policy=st.sampled_from(list(Misfire)),
    catch_up=st.integers(min_value=1, max_value=50),
    grace=st.floats(min_value=0, max_value=60),
)
def test_plan_properties(
    every: float, late: float, policy: Misfire, catch_up: int, grace: float
) -> None:
    timing = Timing(every=every)
    now = T0 + timedelta(seconds=late)
    p = plan(timing, T0, now, misfire=policy, catch_up=catch_up, grace=grace)
    assert p.fires == sorted(set(p.fires)), "fire times unique and ascending"
    assert all(T0 <= t <= now for t in p.fires), "only due fire times"
    assert all((t - T0) % timing.step == timedelta(0) for t in p.fires), "on the grid"
    assert p.next_run_at > now >= p.next_run_at - timing.step or now < T0
    behind = now - T0
    due = [T0 + k * timing.step for k in range(behind // timing.step + 1)] if now >= T0 else []
    on_time = [t for t in due if t >= now - timedelta(seconds=grace)]
    if policy is Misfire.CATCH_UP:
        assert p.fires == due[-catch_up:]
    elif policy is Misfire.SKIP:
        assert p.fires == on_time
    else:
        missed = [t for t in due if t not in on_time]
        assert p.fires == missed[-1:] + on_time


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"cron": None, "every": None}, "cron", "exactly one"),
        ({"cron": "* * * * *", "every": 5}, "cron", "exactly one"),
        ({"cron": "61 * * * *", "every": None}, "cron", "not a cron expression"),
        ({"cron": "every day", "every": None}, "cron", "not a cron expression"),
        ({"cron": None, "every": 0}, "every", "from 1 s"),
        ({"cron": None, "every": -3}, "every", "from 1 s"),
        ({"cron": None, "every": float("nan")}, "every", "seconds"),
        ({"cron": None, "every": "10"}, "every", "seconds"),
        ({"cron": None, "every": 1, "timezone": "Mars/Olympus"}, "timezone", "unknown timezone"),
        ({"cron": None, "every": 1, "timezone": ""}, "timezone", "IANA"),
        ({"cron": None, "every": 1, "timezone": "/etc/passwd"}, "timezone", "unknown timezone"),
    ],
)
def test_bad_timing_is_refused_naming_the_field(
    kwargs: dict[str, object], field: str, fragment: str
) -> None:
    kwargs.setdefault("timezone", "UTC")
    with pytest.raises(InvalidSchedule) as info:
        check_timing(kwargs["cron"], kwargs["every"], kwargs["timezone"])
    assert info.value.field == field
    assert f"invalid {field}" in str(info.value)
    assert fragment in str(info.value)


def test_bad_misfire_and_name_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidSchedule, match="invalid misfire: must be one of skip, run_once"):
        check_misfire("sometimes", 1)
    with pytest.raises(InvalidSchedule, match="invalid catch_up"):
        check_misfire("catch_up", 0)
    with pytest.raises(InvalidSchedule, match="invalid catch_up"):
        check_misfire("catch_up", 10_000)
    with pytest.raises(InvalidSchedule, match="invalid name"):
        check_name("")
    with pytest.raises(InvalidSchedule, match="invalid name"):
        check_name("a\nb")
    assert check_misfire("catch_up", 5) == (Misfire.CATCH_UP, 5)
