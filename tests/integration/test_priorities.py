"""Priorities decide the claim order; the aging share bounds starvation: a job due longer than
``starvation_after`` is claimed within a bounded number of claims, whatever keeps arriving
with a higher priority."""

from __future__ import annotations

import time

import redis
from sqlalchemy import Engine, text

from harvest import dispatcher, store
from harvest.app import Harvest
from harvest.settings import Settings
from tests.helpers import RecordingBroker


def add(engine: Engine, n: int, *, priority: int, age: float, pool: str | None = None) -> list[int]:
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "INSERT INTO harvest_jobs (name, priority, run_at, pool) "
                    "SELECT 'noop', :p, now() - make_interval(secs => :age - g * 0.0001), :pool "
                    "FROM generate_series(1, :n) AS g RETURNING id"
                ),
                {"p": priority, "age": age, "n": n, "pool": pool},
            ).scalars()
        )


def claim(engine: Engine, limit: int, **kwargs: object) -> list[int]:
    with engine.begin() as conn:
        return [c.id for c in store.claim_due(conn, limit=limit, ttl=60, **kwargs)]  # type: ignore[arg-type]


def test_aging_share_is_a_tenth_and_at_least_one() -> None:
    assert [store.aging_share(n) for n in (0, 1, 5, 10, 19, 20, 200)] == [0, 1, 1, 1, 1, 2, 20]


def test_without_aging_low_priority_waits_while_higher_keeps_coming(clean_db: Engine) -> None:
    low = set(add(clean_db, 50, priority=-10, age=600))
    add(clean_db, 3000, priority=10, age=1)
    taken = [job for _ in range(25) for job in claim(clean_db, 20)]
    assert not low & set(taken)


def test_aging_share_claims_every_starving_job_within_a_bound(clean_db: Engine) -> None:
    low = add(clean_db, 50, priority=-10, age=600)  # due 10 minutes ago
    fresh_low = set(add(clean_db, 30, priority=-10, age=5))  # low but not starving
    high = set(add(clean_db, 3000, priority=10, age=1))
    rounds: list[list[int]] = [claim(clean_db, 20, starvation_after=300) for _ in range(25)]
    # Each claim of 20: 2 of the oldest starving jobs first, then 18 by priority.
    assert rounds[0][:2] == low[:2] and set(rounds[0][2:]) <= high
    assert all(len(r) == 20 for r in rounds)
    taken = [job for r in rounds for job in r]
    assert [j for j in taken if j in set(low)] == low  # all 50, oldest first, in 25 claims
    assert not fresh_low & set(taken)
    # Without starving jobs the claim is by priority alone.
    assert set(claim(clean_db, 20, starvation_after=300)) <= high


def test_with_the_dispatchers_watch_a_claim_looks_for_starving_jobs_only_when_it_should(
    clean_db: Engine,
) -> None:
    """The dispatcher's watch (store.ClaimWatch): after a look that found no starving job the
    claims do not look for `every` seconds; once one looks and finds some, every claim takes
    their share until none are left."""
    watch = store.ClaimWatch(every=2.0)
    high = set(add(clean_db, 200, priority=10, age=1))
    low = add(clean_db, 3, priority=-10, age=5)  # not starving yet

    def claim_watched() -> list[int]:
        return claim(clean_db, 10, starvation_after=300, watch=watch)

    assert set(claim_watched()) <= high  # looked: none starving
    with clean_db.begin() as conn:  # now they starve
        conn.execute(
            text(
                "UPDATE harvest_jobs SET run_at = run_at - interval '10 min' WHERE id = ANY(:ids)"
            ),
            {"ids": low},
        )
    assert set(claim_watched()) <= high  # within the watch's two seconds: no look
    time.sleep(2.0)
    rounds = [claim_watched() for _ in range(4)]
    assert [r[0] for r in rounds[:3]] == low  # one of ten each claim, oldest first
    assert all(len(r) == 10 for r in rounds) and set(rounds[3]) <= high
    assert not any(set(r[1:]) - high for r in rounds[:3])


def test_aging_respects_pool_budgets(clean_db: Engine) -> None:
    starving = add(clean_db, 10, priority=-5, age=600, pool="p")
    add(clean_db, 100, priority=5, age=1)
    first = claim(clean_db, 20, starvation_after=300, budgets={"p": 1})
    assert [j for j in first if j in set(starving)] == starving[:1]
    assert len(first) == 20


def test_dispatcher_applies_the_setting(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    settings = migrated.model_copy(
        update={"starvation_after": 60.0, "claim_batch_size": 10, "inflight_window": 10}
    )
    broker = RecordingBroker(settings)
    app = Harvest(settings, broker=broker, redis_client=redis_client)
    try:
        old = add(clean_db, 3, priority=-1, age=120)
        high = add(clean_db, 50, priority=1, age=1)
        report = dispatcher.dispatch(app)
        assert report.claimed == 10
        assert broker.published[:1] == old[:1]
        assert set(broker.published[1:]) <= set(high)
        off = Harvest(
            settings.model_copy(update={"starvation_after": 0.0}), redis_client=redis_client
        )
        with clean_db.begin() as conn:
            conn.execute(
                text("UPDATE harvest_jobs SET status = 'succeeded' WHERE status = 'dispatched'")
            )
        off_broker = RecordingBroker(off.settings)
        off._lazy.broker = off_broker
        dispatcher.dispatch(off)
        assert not set(off_broker.published) & set(old)
        off.close()
    finally:
        app.close()
