"""How the asyncio shell takes a delivered job (harvest.execution.delivery), decided without
I/O: driven here by the core tests' scripted shell."""

from __future__ import annotations

import uuid

import pytest

from harvest.coordination.key_pool import Busy, Lease
from harvest.execution import delivery
from harvest.execution import effects as fx
from harvest.jobs import Started
from harvest.models import JobStatus
from tests.unit.test_execution_core import PLAN, Script, spec

PAIR = (7, uuid.uuid4())
LEASE = Lease("p", 3, "tok", 5, 1e9)


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
    s = Script(LeaseKey=lambda e: LEASE, Start=lambda e: job)
    assert s.run(delivery.key_first(PAIR, spec(pool="p"), PLAN)) == delivery.Keyed(job, LEASE, 0.0)
    assert [type(e).__name__ for e in s.seen] == ["Clock", "LeaseKey", "Start"]


def test_without_a_key_nothing_is_written_and_the_job_is_held_as_any() -> None:
    s = Script(LeaseKey=lambda e: Busy(0.5))
    assert s.run(delivery.key_first(PAIR, spec(pool="p"), PLAN)) is None
    assert not s.of(fx.Start)


@pytest.mark.parametrize(("answer", "counts"), [(None, ("suppressed",)), (JobStatus.CANCELLED, ())])
def test_a_duplicate_or_cancelled_delivery_gives_its_key_back(
    answer: JobStatus | None, counts: tuple[str, ...]
) -> None:
    s = Script(LeaseKey=lambda e: LEASE, Start=lambda e: answer)
    assert s.run(delivery.key_first(PAIR, spec(pool="p"), PLAN)) == counts
    assert s.of(fx.ReleaseKey) == [fx.ReleaseKey(LEASE, used=0)]


def test_a_start_that_fails_gives_the_key_back_before_the_error_goes_on() -> None:
    def fails(e: fx.Start) -> None:
        raise ConnectionError("the server closed the connection")

    s = Script(LeaseKey=lambda e: LEASE, Start=fails)
    with pytest.raises(ConnectionError):
        s.run(delivery.key_first(PAIR, spec(pool="p"), PLAN))
    assert s.seen[-1] == fx.ReleaseKey(LEASE, used=0)
