"""RetryPolicy and should_retry: pure functions, checked as properties over their input space."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harvest.retry import RetryPolicy, should_retry

NAN = float("nan")

# Valid policies with the factors people use (1 to 100); extreme factors have their own test.
policies = st.builds(
    RetryPolicy,
    base=st.floats(min_value=0, max_value=1e6),
    factor=st.floats(min_value=1, max_value=100),
    max_delay=st.floats(min_value=0, max_value=1e7),
    jitter=st.floats(min_value=0, max_value=1, exclude_max=True),
)
attempts = st.integers(min_value=1, max_value=10_000)
seeds = st.integers(min_value=0, max_value=2**32)


def _close_or_below(value: float, bound: float) -> bool:
    return value <= bound or math.isclose(value, bound, rel_tol=1e-9, abs_tol=1e-12)


@given(policies, attempts, seeds)
def test_delay_is_finite_non_negative_and_never_above_max_delay(
    policy: RetryPolicy, attempt: int, seed: int
) -> None:
    delay = policy.delay(attempt, random.Random(seed))
    assert math.isfinite(delay)
    assert 0 <= delay <= policy.max_delay


@given(policies, attempts)
def test_nominal_is_bounded_and_non_decreasing_in_attempt(
    policy: RetryPolicy, attempt: int
) -> None:
    here, following = policy.nominal(attempt), policy.nominal(attempt + 1)
    assert 0 <= here <= policy.max_delay
    assert here <= following


@given(policies, attempts, seeds)
def test_jitter_stays_within_its_fraction_of_nominal(
    policy: RetryPolicy, attempt: int, seed: int
) -> None:
    nominal = policy.nominal(attempt)
    delay = policy.delay(attempt, random.Random(seed))
    low = nominal * (1 - policy.jitter)
    high = min(policy.max_delay, nominal * (1 + policy.jitter))
    assert _close_or_below(low, delay), (low, delay)
    assert _close_or_below(delay, high), (delay, high)


@given(policies, attempts, seeds)
def test_without_jitter_the_delay_is_the_nominal(
    policy: RetryPolicy, attempt: int, seed: int
) -> None:
    exact = RetryPolicy(
        base=policy.base, factor=policy.factor, max_delay=policy.max_delay, jitter=0
    )
    assert exact.delay(attempt, random.Random(seed)) == exact.nominal(attempt)


@given(policies, attempts, seeds)
def test_same_seed_same_delay(policy: RetryPolicy, attempt: int, seed: int) -> None:
    assert policy.delay(attempt, random.Random(seed)) == policy.delay(attempt, random.Random(seed))


def test_documented_schedule_doubles_then_caps() -> None:
    policy = RetryPolicy(base=1.0, factor=2.0, max_delay=600.0, jitter=0.25)
    assert [policy.nominal(a) for a in range(1, 12)] == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
        600,
    ]


def test_jitter_spreads_jobs_that_failed_together() -> None:
    policy = RetryPolicy(base=10.0, jitter=0.25)
    rng = random.Random(7)
    delays = [policy.delay(3, rng) for _ in range(200)]
    assert min(delays) < 40 < max(delays)
    assert len(set(delays)) > 150


@given(
    base=st.floats(min_value=0, max_value=1e6),
    factor=st.floats(min_value=1, max_value=1e300),
    max_delay=st.floats(min_value=0, max_value=1e7),
    attempt=st.integers(min_value=1, max_value=1000),
)
def test_every_policy_the_constructor_accepts_gives_a_delay(
    base: float, factor: float, max_delay: float, attempt: int
) -> None:
    """A steep factor with many attempts must cap at max_delay, not raise OverflowError."""
    policy = RetryPolicy(base=base, factor=factor, max_delay=max_delay)
    assert 0 <= policy.delay(attempt, random.Random(0)) <= max_delay


bad_parameters = st.one_of(
    st.fixed_dictionaries({"base": st.floats(max_value=-1e-300)}),
    st.fixed_dictionaries({"max_delay": st.floats(max_value=-1e-300)}),
    st.fixed_dictionaries({"factor": st.floats(max_value=1, exclude_max=True)}),
    st.fixed_dictionaries({"jitter": st.floats(max_value=-1e-300) | st.floats(min_value=1)}),
)


@given(bad_parameters)
def test_bad_parameters_raise_value_error(params: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**params)


@pytest.mark.parametrize("field", ["base", "max_delay", "factor", "jitter"])
def test_nan_parameter_is_refused(field: str) -> None:
    """NaN compares false to every bound; a policy built from it yields meaningless delays."""
    with pytest.raises(ValueError):
        RetryPolicy(**{field: NAN})


@pytest.mark.parametrize("attempt", [0, -1])
def test_attempts_count_from_one(attempt: int) -> None:
    with pytest.raises(ValueError, match="from 1"):
        RetryPolicy().nominal(attempt)
    with pytest.raises(ValueError, match="from 1"):
        RetryPolicy().delay(attempt)


@given(st.integers(min_value=1, max_value=1000))
def test_should_retry_allows_exactly_max_attempts_runs(max_attempts: int) -> None:
    retries = [should_retry(a, max_attempts) for a in range(1, max_attempts + 1)]
    assert retries == [True] * (max_attempts - 1) + [False]
    assert not should_retry(max_attempts + 1, max_attempts)
