"""A Hypothesis state machine drives the key pool on real Redis against an exact Python model.

The scripts judge time by Redis ``TIME``. Each step reads Redis ``TIME`` just before and just
after the call, so the script's own "now" lies in that bracket; a grant or heartbeat reports its
expiry and so pins "now" exactly. The model then predicts the outcome for the possible "now"s
(the bracket start and every expiry, cooldown end or rate-window slide inside the bracket) and
the real outcome must match one of them: which key is chosen (least loaded, round robin),
Busy and its retry_after, heartbeats and releases of live, expired and reclaimed leases.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from harvest.coordination import keys
from harvest.coordination.key_pool import IDLE_RETRY, Busy, KeyPool, KeySpec, Lease
from harvest.coordination.rate_limit import Rate
from harvest.errors import PoolNotLoaded

US = 1_000_000
KEY_IDS = range(1, 6)
TOLERANCE = 2  # microseconds of float round trips
_pools = itertools.count()


def us(seconds: float) -> int:
    return round(seconds * US)


@dataclass
class KeyModel:
    max: int
    rate: tuple[int, int] | None  # (count, period in us)
    disabled: bool
    cool: int = 0  # cooldown end, us
    log: list[int] = field(default_factory=list)  # grant times, us


@dataclass
class Prediction:
    grants: list[int]  # key ids, in grant order
    event: int | None  # absolute us when a key could be usable again; None: time frees nothing


class Model:
    def __init__(self) -> None:
        self.keys: dict[int, KeyModel] = {}
        self.leases: dict[str, tuple[int, int]] = {}  # token -> (key_id, expiry us)
        self.cursor = 0
        self.loaded = False
        self.last_fence: int | None = None
        self.max_fence = 0

    def sync(self, specs: list[KeySpec]) -> None:
        wanted = {s.key_id: s for s in specs}
        for key_id in list(self.keys):
            if key_id not in wanted:
                del self.keys[key_id]
                self.leases = {t: v for t, v in self.leases.items() if v[0] != key_id}
        for key_id, spec in wanted.items():
            rate = (spec.rate.count, spec.rate.period_micros) if spec.rate else None
            old = self.keys.get(key_id)
            self.keys[key_id] = KeyModel(
                spec.max_concurrency,
                rate,
                spec.status == "disabled",
                old.cool if old else 0,
                old.log if old else [],
            )
        self.loaded = True

    def lose(self) -> None:
        self.keys, self.leases, self.cursor, self.loaded = {}, {}, 0, False
        self.last_fence = None

    def live(self, key_id: int, now: int) -> list[int]:
        return sorted(e for k, e in self.leases.values() if k == key_id and e > now)

    def window(self, key: KeyModel, now: int) -> list[int]:
        return sorted(t for t in key.log if key.rate and t > now - key.rate[1])

    def events(self) -> list[int]:
        found = [e for _, e in self.leases.values()]
        for key in self.keys.values():
            found.append(key.cool)
            found.extend(t + key.rate[1] for t in key.log if key.rate)
        return found

    def candidate_nows(self, t0: int, t1: int) -> list[int]:
        return [t0, *sorted({e for e in self.events() if t0 < e <= t1})]

    def predict(self, now: int, n: int, ttl: int) -> Prediction:
        ids = sorted(self.keys)
        if not ids:
            return Prediction([], None)
        start = (self.cursor + 1) % len(ids)
        order = [ids[(start + i) % len(ids)] for i in range(len(ids))]
        usable = [k for k in order if not self.keys[k].disabled and self.keys[k].cool <= now]
        live = {k: self.live(k, now) for k in usable}
        used = {k: self.window(self.keys[k], now) for k in usable}
        grants: list[int] = []
        for _ in range(n):
            best = self._pick(usable, live, used)
            if best is None:
                break
            grants.append(best)
            live[best] = sorted([*live[best], now + ttl])
            used[best] = [*used[best], now]
        if len(grants) == n:
            return Prediction(grants, None)
        return Prediction(grants, self._event(now, usable, live, used))

    def _admits(self, k: int, live: dict[int, list[int]], used: dict[int, list[int]]) -> bool:
        key = self.keys[k]
        return len(live[k]) < key.max and (key.rate is None or len(used[k]) < key.rate[0])

    def _pick(
        self, usable: list[int], live: dict[int, list[int]], used: dict[int, list[int]]
    ) -> int | None:
        best: int | None = None
        for k in usable:
            if not self._admits(k, live, used):
                continue
            if best is None or self._lighter(k, best, live):
                best = k
        return best

    def _lighter(self, k: int, best: int, live: dict[int, list[int]]) -> bool:
        return len(live[k]) * self.keys[best].max < len(live[best]) * self.keys[k].max

    def _event(
        self, now: int, usable: list[int], live: dict[int, list[int]], used: dict[int, list[int]]
    ) -> int | None:
        events = [k.cool for k in self.keys.values() if not k.disabled and k.cool > now]
        for k in usable:
            key, wait = self.keys[k], now
            if len(live[k]) >= key.max:
                wait = live[k][len(live[k]) - key.max]
            if key.rate and len(used[k]) >= key.rate[0]:
                wait = max(wait, used[k][len(used[k]) - key.rate[0]] + key.rate[1])
            events.append(wait)
        return min(events) if events else None


# Each key keeps one rate period (its count may change, or the limit come and go): a lease
# forgets the grants older than the key's period then (ZREMRANGEBYSCORE), so a period made
# longer later cannot count them again, and the model, which keeps every grant, would disagree
# (issue 13: found by this machine; see test_a_longer_period_counts_only_the_grants_kept).
PERIODS = {1: 0.1, 2: 0.25, 3: 0.1, 4: 0.25, 5: 0.1}


def key_spec(key_id: int) -> st.SearchStrategy[KeySpec]:
    rate = st.one_of(st.none(), st.builds(Rate, st.integers(1, 3), st.just(PERIODS[key_id])))
    return st.builds(
        KeySpec,
        key_id=st.just(key_id),
        max_concurrency=st.integers(1, 2),
        rate=rate,
        status=st.sampled_from(["active", "active", "active", "disabled"]),
    )


specs = st.lists(
    st.sampled_from(list(KEY_IDS)).flatmap(key_spec),
    min_size=0,
    max_size=4,
    unique_by=lambda s: s.key_id,
)
ttls = st.sampled_from([0.05, 0.15, 5.0])
probes = st.sampled_from([None, -2000, -300, 300, 2000])  # us around the next event
# Which granted lease a rule acts on. Not a Bundle: how many leases a step grants depends on
# real time (Busy or not), and a Bundle's draw has as many choices as it holds leases, so
# Hypothesis saw the same choices drawn with different bounds from one run to the next and
# stopped with FlakyStrategyDefinition ("Inconsistent data generation", issue 13). An index
# drawn from a fixed range, taken modulo the leases granted so far, draws the same way always.
picks = st.integers(0, 63)


class KeyPoolMachine(RuleBasedStateMachine):
    client: redis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.name = f"sm{next(_pools)}"
        self.pool = KeyPool(self.client, self.name)
        self.model = Model()
        self.granted: list[Lease] = []  # every lease granted so far (live or not)

    def pick(self, index: int) -> Lease | None:
        return self.granted[index % len(self.granted)] if self.granted else None

    def now(self) -> int:
        sec, micro = self.client.time()
        return sec * US + micro

    @initialize(specs=specs.filter(bool))
    def load(self, specs: list[KeySpec]) -> None:
        self.pool.sync(specs)
        self.model.sync(specs)

    @rule(specs=specs)
    def resync(self, specs: list[KeySpec]) -> None:
        self.load(specs)

    @rule()
    def lose_redis_data(self) -> None:
        names = [
            keys.pool_epoch(self.name),
            keys.pool_members(self.name),
            keys.pool_cursor(self.name),
            keys.pool_fence(self.name),
        ]
        for k in KEY_IDS:
            names += [
                keys.pool_key_config(self.name, k),
                keys.pool_key_leases(self.name, k),
                keys.pool_key_rate(self.name, k),
            ]
        self.client.delete(*names)
        self.model.lose()

    @rule(ttl=ttls, n=st.integers(1, 3), probe=probes)
    def lease(self, ttl: float, n: int, probe: int | None) -> None:
        self.sleep_to_next_event(probe)
        t0 = self.now()
        try:
            result = self.pool.lease("m", ttl) if n == 1 else self.pool.lease_many("m", ttl, n)
        except PoolNotLoaded:
            assert not self.model.loaded
            return
        t1 = self.now()
        assert self.model.loaded
        got = [result] if isinstance(result, Lease) else result
        if isinstance(got, Busy):
            self.check_busy(got, t0, t1, n, us(ttl))
            return
        self.check_grants(got, t0, t1, ttl, n)
        self.granted.extend(got)

    def check_busy(self, busy: Busy, t0: int, t1: int, n: int, ttl: int) -> None:
        retry = us(busy.retry_after)
        fits = []
        for now in self.model.candidate_nows(t0, t1):
            p = self.model.predict(now, n, ttl)
            if p.grants:
                continue
            if p.event is None:
                fits.append(busy.retry_after == IDLE_RETRY)
            else:
                fits.append(p.event - t1 - TOLERANCE <= retry <= p.event - t0 + TOLERANCE)
        assert any(fits), f"unexpected {busy} in [{t0}, {t1}]"
        self.advance_cursor()

    def check_grants(self, got: list[Lease], t0: int, t1: int, ttl: float, n: int) -> None:
        now = us(got[0].expires_at) - us(ttl)
        assert t0 <= now <= t1 + TOLERANCE, (t0, now, t1)
        predicted = self.model.predict(now, n, us(ttl))
        assert [lease.key_id for lease in got] == predicted.grants
        for lease in got:
            key = self.model.keys[lease.key_id]
            assert len(self.model.live(lease.key_id, now)) < key.max, "over max_concurrency"
            assert key.rate is None or len(self.model.window(key, now)) < key.rate[0], "over rate"
            assert us(lease.expires_at) == now + us(ttl)
            self.check_fence(lease.fence)
            self.model.leases[lease.token] = (lease.key_id, now + us(ttl))
            if key.rate:  # calls made while a key has no rate limit are not counted later
                key.log.append(now)
        self.advance_cursor()

    def check_fence(self, fence: int) -> None:
        if self.model.last_fence is not None:
            assert fence == self.model.last_fence + 1
        assert fence > self.model.max_fence
        self.model.last_fence = self.model.max_fence = fence

    def advance_cursor(self) -> None:
        if self.model.keys:
            self.model.cursor += 1

    @rule(index=picks, ttl=ttls, probe=probes)
    def heartbeat(self, index: int, ttl: float, probe: int | None) -> None:
        lease = self.pick(index)
        if lease is None:
            return
        self.sleep_to_expiry(lease, probe)
        t0 = self.now()
        until = self.pool.heartbeat_until(lease, ttl)
        t1 = self.now()
        held = self.model.leases.pop(lease.token, None)
        if until is None:
            assert held is None or held[1] <= t1, "a live lease was refused a heartbeat"
            return
        now = us(until) - us(ttl)
        assert held is not None and t0 <= now <= t1 + TOLERANCE and held[1] > now
        self.model.leases[lease.token] = (held[0], us(until))

    @rule(index=picks, probe=probes)
    def release(self, index: int, probe: int | None) -> None:
        lease = self.pick(index)
        if lease is None:
            return
        self.sleep_to_expiry(lease, probe)
        t0 = self.now()
        released = self.pool.release(lease)
        t1 = self.now()
        held = self.model.leases.pop(lease.token, None)
        if released:
            assert held is not None and held[1] > t0, "released a lease that was not live"
        else:
            assert held is None or held[1] <= t1, "failed to release a live lease"

    @rule(key_id=st.sampled_from(list(KEY_IDS)), seconds=st.sampled_from([0.05, 0.15]))
    def cooldown(self, key_id: int, seconds: float) -> None:
        t0 = self.now()
        until = self.pool.cooldown(key_id, seconds)
        t1 = self.now()
        key = self.model.keys.get(key_id)
        if until is None:
            assert key is None
            return
        assert key is not None
        end = us(until)
        assert end == key.cool or t0 <= end - us(seconds) <= t1 + TOLERANCE
        assert end >= key.cool
        key.cool = end

    @rule(key_id=st.sampled_from(list(KEY_IDS)), disable=st.booleans())
    def toggle(self, key_id: int, disable: bool) -> None:
        done = self.pool.disable(key_id) if disable else self.pool.enable(key_id)
        assert done == (key_id in self.model.keys)
        if done:
            self.model.keys[key_id].disabled = disable

    @rule(seconds=st.sampled_from([0.02, 0.07, 0.16]))
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @rule(offset=probes)
    def sleep_to_next_event(self, offset: int | None) -> None:
        """Probe a boundary: just before or after the next expiry, cooldown end or slide."""
        if offset is None:
            return
        self.sleep_to(self.model.events(), offset)

    def sleep_to(self, events: list[int], offset: int | None) -> None:
        if offset is None:
            return
        now = self.now()
        upcoming = [e for e in events if now < e + offset < now + 400_000]
        if upcoming:
            time.sleep((min(upcoming) + offset - now) / US)

    def sleep_to_expiry(self, lease: Lease, offset: int | None) -> None:
        held = self.model.leases.get(lease.token)
        self.sleep_to([held[1]] if held else [], offset)

    @invariant()
    def redis_matches_model(self) -> None:
        if not self.model.loaded:
            with pytest.raises(PoolNotLoaded):
                self.pool.snapshot()
            return
        t0 = self.now()
        states = self.pool.snapshot()
        t1 = self.now()
        assert [s.key_id for s in states] == sorted(self.model.keys)
        for state in states:
            key = self.model.keys[state.key_id]
            assert state.max_concurrency == key.max
            rate = (state.rate.count, state.rate.period_micros) if state.rate else None
            assert rate == key.rate
            if key.disabled:
                assert state.status == "disabled"
            elif key.cool > t1:
                assert state.status == "cooling"
            elif key.cool <= t0:
                assert state.status == "active"
            live_lo, live_hi = (
                len(self.model.live(state.key_id, t1)),
                len(self.model.live(state.key_id, t0)),
            )
            assert live_lo <= state.live_leases <= live_hi
            used_lo, used_hi = len(self.model.window(key, t1)), len(self.model.window(key, t0))
            assert used_lo <= state.rate_used <= used_hi


def test_key_pool_matches_model(redis_client: redis.Redis) -> None:
    machine = type("Machine", (KeyPoolMachine,), {"client": redis_client})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # shrinking real-time runs takes minutes
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_a_longer_period_counts_only_the_grants_kept(redis_client: redis.Redis) -> None:
    """What the machine found once a key's period could change (kept as its example): grants
    older than the period in force at a lease are forgotten, so a period lengthened afterwards
    counts only the grants still kept. A rate change applies from the calls it can see."""
    pool = KeyPool(redis_client, f"sm{next(_pools)}")
    pool.sync([KeySpec(key_id=2, max_concurrency=3, rate=Rate(2, 0.1), status="active")])
    assert isinstance(pool.lease("m", 5.0), Lease)
    time.sleep(0.12)
    assert isinstance(pool.lease("m", 5.0), Lease)  # the first grant is forgotten here
    pool.sync([KeySpec(key_id=2, max_concurrency=3, rate=Rate(3, 0.25), status="active")])
    (state,) = pool.snapshot()
    assert state.rate_used == 1
