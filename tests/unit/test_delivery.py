"""How the asyncio shell takes a delivered job (harvest.execution.delivery), decided without
I/O: driven here by a scripted shell."""

from __future__ import annotations

import uuid
from collections.abc import Generator
from typing import Any

import pytest

from harvest.app import JobSpec
from harvest.coordination.key_pool import Busy, Lease
from harvest.execution import core, delivery
from harvest.execution import effects as fx
from harvest.jobs import Started
from harvest.models import JobStatus
from harvest.retry import RetryPolicy

PLAN = core.Plan(
    worker="host:1", key_wait=1.0, unknown_job_grace=60.0, retry_base=1.0, lease_ttl=30.0
)
PAIR = (7, uuid.uuid4())
LEASE = Lease("p", 3, "tok", 5, 1e9)


def spec(pool: Any = None, rate: str | None = None, cost: Any = None) -> JobSpec:
    return JobSpec(
        "j", lambda ctx: None, "execution", 3, 10.0, (Exception,),
        RetryPolicy(base=2.0, jitter=0.0), pool, rate, cost=cost,
    )  # fmt: skip


def drive(
    gen: Generator[Any, Any, Any], seen: list[Any] | None = None, **answers: Any
) -> tuple[Any, list[Any]]:
    """Run ``gen``, answering each effect by its type's name (an exception is thrown into it);
    every effect it yields goes to ``seen``."""
    seen = [] if seen is None else seen
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as stop:
            return stop.value, seen
        seen.append(effect)
        answer = answers.get(type(effect).__name__, 0.0)
        value, error = (None, answer) if isinstance(answer, BaseException) else (answer, None)


def test_only_a_job_with_no_pool_and_no_rate_limit_starts_at_its_hold() -> None:
    assert delivery.starts_at_hold(spec())
    assert not delivery.starts_at_hold(spec(pool="p"))
    assert not delivery.starts_at_hold(spec(rate="10/s"))
    assert not delivery.starts_at_hold(None)  # unknown: held, then deferred


def test_only_a_job_of_one_pool_with_no_rate_limit_or_cost_tries_its_key_first() -> None:
    assert delivery.leases_first(spec(pool="p"))
    assert not delivery.leases_first(spec(pool="p,q"))  # fallback pools: the gate's turn
    assert not delivery.leases_first(spec(pool="p", rate="10/s"))
    assert not delivery.leases_first(spec(pool="p", cost=100))  # needs its payload first
    assert not delivery.leases_first(spec())
    assert not delivery.leases_first(None)


def test_with_its_key_the_start_is_the_hold() -> None:
    job = Started(7, PAIR[1], "j", {}, 1, 3, 10.0, False)
    result, seen = drive(delivery.key_first(PAIR, spec(pool="p"), PLAN), LeaseKey=LEASE, Start=job)
    assert result == delivery.Keyed(job, LEASE, 0.0)
    assert [type(e).__name__ for e in seen] == ["Clock", "LeaseKey", "Start"]


def test_without_a_key_nothing_is_written_and_the_job_is_held_as_any() -> None:
    result, seen = drive(delivery.key_first(PAIR, spec(pool="p"), PLAN), LeaseKey=Busy(0.5))
    assert result is None
    assert not any(isinstance(e, fx.Start) for e in seen)


@pytest.mark.parametrize(("answer", "counts"), [(None, ("suppressed",)), (JobStatus.CANCELLED, ())])
def test_a_duplicate_or_cancelled_delivery_gives_its_key_back(
    answer: JobStatus | None, counts: tuple[str, ...]
) -> None:
    result, seen = drive(
        delivery.key_first(PAIR, spec(pool="p"), PLAN), LeaseKey=LEASE, Start=answer
    )
    assert result == counts
    assert fx.ReleaseKey(LEASE, used=0) in seen


def test_a_start_that_fails_gives_the_key_back_before_the_error_goes_on() -> None:
    failure = ConnectionError("the server closed the connection")
    seen: list[Any] = []
    with pytest.raises(ConnectionError):
        drive(delivery.key_first(PAIR, spec(pool="p"), PLAN), seen, LeaseKey=LEASE, Start=failure)
    assert seen[-1] == fx.ReleaseKey(LEASE, used=0)
