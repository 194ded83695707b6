"""The loopback service's per-key limits, without sockets: a key's state driven by a made-up
clock. A stateful model checks the two limits against every sequence of arrivals and ends."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harvest.loopback import KeyState, LoopKey, load_keys, mean_latency, window_peaks


def state(concurrency: int = 2, rate: int | None = None, period: float = 60.0) -> KeyState:
    key_state = KeyState(LoopKey("k", "sk-test", concurrency, rate, period))
    key_state.reset()
    return key_state


def test_concurrency_refuses_the_call_beyond_c_with_the_wait_until_the_first_end() -> None:
    s = state(concurrency=2)
    assert s.admit(0.0, 1.0) is None
    assert s.admit(0.2, 0.5) is None
    assert s.admit(0.3, 1.0) == pytest.approx(0.4)  # the second call ends at 0.7
    s.release(0.7)
    assert s.admit(0.7, 1.0) is None
    assert s.stats()["peak_in_flight"] == 2
    assert s.stats()["peak_attempted"] == 3
    assert s.stats()["http_429_concurrency"] == 1


def test_rate_counts_admissions_in_a_sliding_window_and_says_when_one_leaves() -> None:
    s = state(concurrency=100, rate=3, period=60.0)
    for t in (0.0, 10.0, 20.0):
        assert s.admit(t, 0.1) is None
    assert s.admit(30.0, 0.1) == pytest.approx(30.0)  # the call of t=0 leaves at 60
    assert s.admit(59.999, 0.1) == pytest.approx(0.001)
    assert s.admit(60.0, 0.1) is None
    assert s.admit(60.5, 0.1) == pytest.approx(9.5)  # next to leave: t=10
    counts = s.stats()
    assert (counts["http_429"], counts["http_429_rate"]) == (3, 3)


def test_a_refused_call_does_not_count_against_the_window() -> None:
    s = state(concurrency=100, rate=1, period=10.0)
    assert s.admit(0.0, 0.1) is None
    for t in range(1, 10):
        assert s.admit(float(t), 0.1) is not None
    assert s.admit(10.0, 0.1) is None


def test_both_limits_wait_for_the_later_of_the_two() -> None:
    s = state(concurrency=1, rate=1, period=10.0)
    assert s.admit(0.0, 2.0) is None
    assert s.admit(1.0, 1.0) == pytest.approx(9.0)


def test_reset_keeps_what_is_in_flight() -> None:
    s = state(concurrency=3)
    s.admit(0.0, 5.0)
    s.admit(0.0, 6.0)
    s.reset()
    assert s.stats()["peak_in_flight"] == 2
    assert s.stats()["requests"] == 0
    assert s.admit(1.0, 1.0) is None
    assert s.admit(1.0, 1.0) is not None


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 8),
    st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.01, 4.0)), min_size=1, max_size=80),
)
def test_never_more_than_c_in_flight_nor_r_per_window(
    concurrency: int, rate: int, arrivals: list[tuple[float, float]]
) -> None:
    """Calls arrive (gap, latency); ends are released when due. Admitted calls never overlap
    more than C, no window of the period holds more than R admissions, and a refused call
    retried exactly after its Retry-After would find that limit's room (here: the model's)."""
    period = 5.0
    s = state(concurrency, rate, period)
    now, admitted, running = 0.0, [], []
    for gap, latency in arrivals:
        now += gap
        for end in [e for e in running if e <= now]:
            running.remove(end)
            s.release(end)
        wait = s.admit(now, latency)
        if wait is None:
            admitted.append(now)
            running.append(now + latency)
            assert len(running) <= concurrency
        else:
            assert wait > 0
            soonest = []
            if len(running) >= concurrency:
                soonest.append(min(running))
            recent = [t for t in admitted if t > now - period]
            if len(recent) >= rate:
                soonest.append(recent[-rate] + period)
            assert soonest
            assert math.isclose(wait, max(0.001, max(soonest) - now), abs_tol=1e-9)
    for i, t in enumerate(admitted):
        assert sum(1 for u in admitted[i:] if u < t + period) <= rate
    assert s.stats()["peak_in_flight"] <= concurrency


def test_mean_of_the_lognormal() -> None:
    assert mean_latency(1.0, 0.3) == pytest.approx(1.046, abs=1e-3)
    assert mean_latency(2.0, 0.0) == 2.0


def test_keys_from_json() -> None:
    keys = load_keys({"keys": [{"name": "a", "secret": "s", "concurrency": 4, "rate": 120}]})
    assert keys == [LoopKey("a", "s", 4, 120, 60.0)]
    assert "secret" not in keys[0].public()


# --- token budgets ----------------------------------------------------------------------------


def budget(tpm: int, token_period: float = 60.0) -> KeyState:
    key_state = KeyState(LoopKey("k", "sk-test", 100, None, 60.0, tpm, token_period))
    key_state.reset()
    return key_state


def test_tokens_beyond_the_budget_are_refused_until_enough_leave_the_window() -> None:
    s = budget(1000)
    assert s.admit(0.0, 0.1, 600) is None
    assert s.admit(10.0, 0.1, 300) is None
    assert s.admit(20.0, 0.1, 200) == pytest.approx(40.0)  # the 600 of t=0 leave at 60
    assert s.admit(20.0, 0.1, 100) is None  # a smaller call still fits: exactly 1000
    assert s.admit(60.0, 0.1, 200) is None
    stats = s.stats()
    assert (stats["http_429_tokens"], stats["peak_window_tokens"]) == (1, 1000)
    assert stats["peak_window_tokens_attempted"] == 1100
    assert s.headers(60.0)["x-ratelimit-remaining-tokens"] == str(1000 - 600)


def test_a_call_larger_than_the_budget_never_fits() -> None:
    s = budget(100)
    assert s.admit(0.0, 0.1, 101) == pytest.approx(86_400.0)
    assert s.stats()["http_429_tokens"] == 1


def test_window_peaks_from_the_log() -> None:
    def e(key: str, start: float, tokens: int, status: int = 200) -> dict[str, object]:
        return {"key": key, "start": start, "tokens": tokens, "status": status}

    log = [e("a", 0.0, 500), e("a", 30.0, 400), e("a", 59.0, 100), e("a", 60.0, 700),
           e("a", 61.0, 900, 429), e("b", 5.0, 50, 500)]  # fmt: skip
    # windows (t - 60, t]: at 59 -> 1000; at 60 the call of t=0 has left -> 400+100+700 = 1200
    assert window_peaks(log) == {"a": 1200, "b": 50}
    assert window_peaks(log, period=10.0) == {"a": 800, "b": 50}


@given(calls=st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 400)), min_size=1, max_size=60))
@settings(max_examples=100, deadline=None)
def test_never_more_tokens_than_the_budget_in_any_window(calls: list[tuple[float, int]]) -> None:
    s = budget(1000, token_period=10.0)
    now, admitted = 0.0, []
    for gap, tokens in calls:
        now += gap
        if s.admit(now, 0.0, tokens) is None:
            admitted.append({"key": "k", "start": now, "tokens": tokens, "status": 200})
            s.release(now)
    assert window_peaks(admitted, period=10.0).get("k", 0) <= 1000
    assert s.stats()["peak_window_tokens"] <= 1000


def test_true_limits_below_the_declared_ones() -> None:
    """A key declared with C=4 and 10 a minute that really allows 2 and 5: refused at its true
    limits; the headers announce the true rate (concurrency is never announced)."""
    key = LoopKey("k", "sk-x", 4, rate=10, true_concurrency=2, true_rate=5)
    state = KeyState(key)
    state.reset()
    assert state.admit(0.0, 1.0) is None and state.admit(0.0, 1.0) is None
    assert state.admit(0.0, 1.0) is not None, "a third call in flight is over the true C"
    assert state.counts["http_429_concurrency"] == 1
    state.release(1.0)
    state.release(1.0)
    for t in (2.0, 4.0, 6.0):
        assert state.admit(t, 0.1) is None
        state.release(t + 0.1)
    assert state.admit(8.0, 0.1) is not None, "a sixth call in the minute is over the true R"
    headers = state.headers(8.0)
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert key.public()["true_concurrency"] == 2
