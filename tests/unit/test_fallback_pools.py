"""Fallback pools without I/O: the door's check of ``pool=``, the core's choice of a pool
(driven by a scripted shell), and the dispatcher's sharing of waiting jobs between routes."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from harvest.app import Harvest, JobSpec
from harvest.context import JobContext
from harvest.coordination import fallback
from harvest.coordination.key_pool import Busy, Lease
from harvest.dispatcher import waiting_for
from harvest.errors import InvalidCost, InvalidOption, InvalidPool
from harvest.execution import core, tracking
from harvest.execution import effects as fx
from harvest.retry import RetryPolicy
from harvest.settings import Settings
from tests.unit.test_execution_core import PLAN, Script, started

# --- the door -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        (None, None),
        ("openai", "openai"),
        (["azure-gpt4", "openai-gpt4"], "azure-gpt4,openai-gpt4"),
        (("a", "b", "c"), "a,b,c"),
        (["only"], "only"),
    ],
)
def test_a_pool_or_a_list_of_pools_is_kept_in_order(given: Any, stored: str | None) -> None:
    assert fallback.route(given) == stored
    assert fallback.pools(stored) == (
        () if given is None else tuple([given] if isinstance(given, str) else given)
    )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ([], "empty"),
        ((), "empty"),
        (["a", "b", "a"], "'a' is listed more than once"),
        (["a", "a,b"], "invalid pool name 'a,b'"),
        (["a", ""], "invalid pool name ''"),
        ("a,b", "invalid pool name 'a,b'"),
        (["a", "has space"], "invalid pool name 'has space'"),
        (["a", 3], "must be a string, got 3"),
        ({"a", "b"}, "must be a pool name or a list of them"),
        (b"a", "must be a pool name or a list of them"),
        ([f"p{i}" for i in range(9)], "at most 8"),
    ],
)
def test_a_malformed_pool_list_is_refused_with_a_typed_error(given: Any, says: str) -> None:
    with pytest.raises(InvalidPool) as caught:
        fallback.route(given)
    assert says in str(caught.value)
    assert caught.value.option == "pool" and caught.value.pools == given
    assert isinstance(caught.value, InvalidOption)  # what the door's callers already catch


def test_the_decorator_refuses_a_bad_list_and_registers_nothing() -> None:
    app = Harvest(Settings())
    with pytest.raises(InvalidPool, match="listed more than once"):

        @app.job("twice", pool=["a", "a"])
        def twice(ctx: JobContext) -> None: ...

    with pytest.raises(InvalidPool, match="empty"):
        app.job("none", pool=[], cost=10)
    assert app.jobs == {}

    @app.job("fine", pool=["azure-gpt4", "openai-gpt4"], cost=100)
    def fine(ctx: JobContext) -> None: ...

    assert app.jobs["fine"].pool == "azure-gpt4,openai-gpt4"


# --- the core's choice ----------------------------------------------------------------------

POOLS = ("first", "second")


def spec(pool: str | None = "first,second") -> JobSpec:
    return JobSpec(
        "j", lambda ctx: None, "execution", 3, 10.0, (Exception,),
        RetryPolicy(base=2.0, jitter=0.0), pool,
    )  # fmt: skip


def lease_of(pool: str) -> Lease:
    return Lease(pool, 1, "tok", 5, 1e9)


def answers(**by_pool: Any) -> Any:
    """A LeaseKey answer per pool: a Lease, a Busy, None (not loaded), or a list of them in
    the order they are asked for."""

    def answer(e: fx.LeaseKey) -> Any:
        value = by_pool[e.pool]
        return value.pop(0) if isinstance(value, list) else value

    return answer


def gate(script: Script, job: JobSpec | None = None) -> Any:
    t = tracking.Tracked(7, uuid.uuid4(), "j", 1, max_attempts=3)
    script.answers.setdefault("Start", lambda e: started())  # a job that waits starts first
    return script.run(core.gate(job or spec(), t, PLAN))


def test_the_first_pool_serves_when_it_can_and_the_second_is_not_asked() -> None:
    s = Script(LeaseKey=answers(first=lease_of("first"), second=lease_of("second")))
    assert gate(s).pool == "first"
    assert [e.pool for e in s.of(fx.LeaseKey)] == ["first"]


@pytest.mark.parametrize(
    "why", [Busy(1.0), Busy(12.0), Busy(0.2)], ids=["disabled", "cooling", "busy"]
)
def test_a_pool_that_cannot_serve_is_passed_over_at_once(why: Busy) -> None:
    s = Script(LeaseKey=answers(first=why, second=lease_of("second")))
    assert gate(s).pool == "second"
    assert [e.pool for e in s.of(fx.LeaseKey)] == ["first", "second"]
    assert not s.of(fx.AwaitKey)  # no wait: the second pool served in the same pass


def test_the_first_pool_is_used_again_as_soon_as_it_can_serve() -> None:
    first = [Busy(0.1), lease_of("first")]
    s = Script(LeaseKey=answers(first=first, second=[Busy(5.0), lease_of("second")]))
    assert gate(s).pool == "first"  # the next pass starts from the first pool again
    assert [e.pool for e in s.of(fx.LeaseKey)] == ["first", "second", "first"]
    (waited,) = s.of(fx.AwaitKey)
    assert waited.pool == "first"  # waits where a key frees first


def test_no_pool_within_key_wait_steps_back_with_its_attempt_refunded() -> None:
    s = Script(LeaseKey=answers(first=Busy(1.0), second=Busy(0.3)), Defer=lambda e: True,
               Start=lambda e: started())  # fmt: skip
    t = tracking.Tracked(7, uuid.uuid4(), "j", 1, max_attempts=3)
    assert s.run(core.attempt(t, spec(), PLAN)) == ("deferred",)
    assert s.of(fx.Defer)[0].row.started  # the attempt begun for the wait is refunded
    assert "no key free in pools 'first', 'second'" in s.of(fx.Notify)[0].event.reason
    assert {w.pool for w in s.of(fx.AwaitKey)} == {"second"}


def test_a_pool_redis_lost_is_rebuilt_once_each() -> None:
    s = Script(LeaseKey=answers(first=[None, Busy(1.0)], second=[None, lease_of("second")]))
    assert gate(s).pool == "second"
    assert [e.pool for e in s.of(fx.LoadPool)] == ["first", "second"]


def test_a_cost_too_big_for_one_pool_falls_back_and_for_all_is_refused() -> None:
    s = Script(LeaseKey=answers(first=Busy(1.0, never=True), second=lease_of("second")))
    assert gate(s).pool == "second"
    s = Script(LeaseKey=answers(first=Busy(1.0, never=True), second=Busy(1.0, never=True)))
    refused = gate(s)
    assert isinstance(refused, core.Refused) and isinstance(refused.error, InvalidCost)
    assert "pools 'first', 'second'" in str(refused.error)
    s = Script(
        LeaseKey=answers(first=Busy(1.0, never=True), second=[Busy(0.1), lease_of("second")])
    )
    assert gate(s).pool == "second"  # a pool that can never serve is not waited on
    assert [w.pool for w in s.of(fx.AwaitKey)] == ["second"]


def test_the_handler_is_told_which_pool_served() -> None:
    s = Script(LeaseKey=answers(first=Busy(3.0), second=lease_of("second")),
               Start=lambda e: started(), Finish=lambda e: True,
               RunHandler=lambda e: fx.HandlerResult(value=e.lease.pool))  # fmt: skip
    t = tracking.Tracked(7, uuid.uuid4(), "j", 1)
    s.run(core.attempt(t, spec(), PLAN))
    assert s.of(fx.Finish)[0].row.result_json == '"second"'
    assert [r.lease.pool for r in s.of(fx.ReleaseKey)] == ["second"]
    ctx = JobContext(7, 1, 3, "j", lease=lease_of("second"))
    assert ctx.pool == "second" and JobContext(7, 1, 3, "j").pool is None


def test_soonest_prefers_the_earlier_pool_on_a_tie() -> None:
    assert core.soonest({"a": Busy(0.5), "b": Busy(0.5)}) == ("a", 0.5)
    assert core.soonest({"a": Busy(0.5), "b": Busy(0.1)}) == ("b", 0.1)
    assert core.soonest({"a": Busy(0.01, never=True), "b": Busy(0.4)}) == ("b", 0.4)


# --- dispatch -------------------------------------------------------------------------------


def test_jobs_waiting_for_any_shared_pool_count_against_a_route() -> None:
    waiting = {"a": 3, "a,b": 5, "b": 7, "c": 11}
    assert waiting_for("a", waiting) == 8  # its own, and the fallback jobs that may take a
    assert waiting_for("a,b", waiting) == 15
    assert waiting_for("c", waiting) == 11
    assert waiting_for("d", waiting) == 0
