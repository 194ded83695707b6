"""Real OS processes lease from one key pool; an oracle checks what they recorded.

16 holder processes (spawned, each with its own Redis connection) lease from 8 keys with
max_concurrency 1 or 2 (two keys also rate limited) for HARVEST_ORACLE_SECONDS (default 30).
Each records when it held which key (wall clock, the same clock Redis ``TIME`` reads on this
machine). A sweep line then proves no instant had more holders of a key than its limit.
Two more tests kill -9 and SIGSTOP a holder in the middle of a lease.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import random
import signal
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import redis

from harvest.coordination.key_pool import Busy, KeyPool, KeySpec, Lease
from harvest.coordination.rate_limit import Rate
from harvest.settings import Settings

SPEC = [
    KeySpec(i, 1 if i % 2 else 2, rate=Rate(20, 1.0) if i in (7, 8) else None) for i in range(1, 9)
]
LIMITS = {spec.key_id: spec.max_concurrency for spec in SPEC}
RATES = {spec.key_id: spec.rate for spec in SPEC if spec.rate}
HOLDERS = 16
TTL = 0.5
US = 1_000_000

Record = dict[str, Any]
spawn = multiprocessing.get_context("spawn")


# --- the oracle ---------------------------------------------------------------------------


def concurrency_violations(records: list[Record], limits: dict[int, int]) -> list[str]:
    """Sweep each key's [start, end] intervals; report any instant above the key's limit."""
    events: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in records:
        events[r["key"]] += [(r["start"], 1), (r["end"], -1)]  # ends sort before starts
    found = []
    for key, key_events in events.items():
        held = 0
        for at, delta in sorted(key_events):
            held += delta
            if held > limits[key]:
                found.append(f"key {key}: {held} holders at {at:.6f} (limit {limits[key]})")
    return found


def rate_violations(records: list[Record], rates: dict[int, Rate]) -> list[str]:
    """Grant times (exact, from Redis) of a rate-limited key: N+1 never within one period."""
    found = []
    for key, rate in rates.items():
        grants = sorted(r["grant"] for r in records if r["key"] == key)
        for i in range(len(grants) - rate.count):
            if grants[i + rate.count] - grants[i] < rate.period_micros:
                found.append(f"key {key}: {rate.count + 1} grants within {rate} from {grants[i]}")
    return found


def fence_order_violations(records: list[Record], limits: dict[int, int]) -> list[str]:
    """On a key of limit 1, a later fence never started holding before an earlier one."""
    found = []
    for key, limit in limits.items():
        if limit == 1:
            mine = sorted((r for r in records if r["key"] == key), key=lambda r: r["fence"])
            found += [
                f"key {key}: fence {b['fence']} started before fence {a['fence']}"
                for a, b in itertools.pairwise(mine)
                if b["start"] < a["end"]
            ]
    return found


def test_oracle_detects_overlap_and_rate_excess() -> None:
    ok = [{"key": 1, "fence": 1, "start": 0.0, "end": 1.0, "grant": 0}]
    assert concurrency_violations([*ok, {"key": 1, "start": 1.0, "end": 2.0}], {1: 1}) == []
    bad = [*ok, {"key": 1, "fence": 2, "start": 0.5, "end": 2.0, "grant": 400_000}]
    assert concurrency_violations(bad, {1: 1})
    assert fence_order_violations(bad, {1: 1})
    assert rate_violations(bad, {1: Rate(1, 1.0)})
    assert not rate_violations(bad, {1: Rate(2, 1.0)})


# --- holder processes ---------------------------------------------------------------------


def _hold_one(pool: KeyPool, lease: Lease, rng: random.Random) -> Record:
    start = time.time()
    held_until = lease.expires_at
    if rng.random() < 0.05:  # a long call, kept alive by heartbeats
        for _ in range(3):
            time.sleep(0.1)
            until = pool.heartbeat_until(lease, TTL)
            if until is None:
                break
            held_until = until
    else:
        time.sleep(rng.uniform(0.001, 0.015))
    end = time.time()
    released = pool.release(lease)
    return {
        "key": lease.key_id,
        "fence": lease.fence,
        "start": start,
        # a lost lease was ours only until its last known expiry
        "end": end if released else min(end, held_until),
        "grant": round(lease.expires_at * US) - round(TTL * US),
        "released": released,
    }


def holder(redis_url: str, pool_name: str, seconds: float, out: str, seed: int) -> None:
    client = redis.Redis.from_url(redis_url)
    pool = KeyPool(client, pool_name)
    rng = random.Random(seed)
    records = []
    deadline = time.time() + seconds
    while time.time() < deadline:
        got = pool.lease(f"holder-{seed}", TTL)
        if isinstance(got, Busy):
            time.sleep(min(got.retry_after, 0.02) * rng.random())
            continue
        records.append(_hold_one(pool, got, rng))
    Path(out).write_text(json.dumps(records))
    client.close()


@pytest.mark.slow
def test_no_key_over_its_limit_across_processes(
    redis_client: redis.Redis, settings: Settings, tmp_path: Path
) -> None:
    seconds = float(os.environ.get("HARVEST_ORACLE_SECONDS", "30"))
    KeyPool(redis_client, "oracle").sync(SPEC)
    outs = [tmp_path / f"holder-{i}.json" for i in range(HOLDERS)]
    procs = [
        spawn.Process(target=holder, args=(settings.redis_url, "oracle", seconds, str(out), i))
        for i, out in enumerate(outs)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=seconds + 120)
    assert [proc.exitcode for proc in procs] == [0] * HOLDERS
    per_holder = [json.loads(out.read_text()) for out in outs]
    records = [r for rs in per_holder for r in rs]

    assert concurrency_violations(records, LIMITS) == []
    assert rate_violations(records, RATES) == []
    assert fence_order_violations(records, LIMITS) == []
    assert {r["key"] for r in records} == set(LIMITS), "every key was used"
    assert all(rs for rs in per_holder), "every holder got leases"
    assert len({r["fence"] for r in records}) == len(records), "fences are unique"
    assert len(records) > 20 * seconds
    live = [s.live_leases for s in KeyPool(redis_client, "oracle").snapshot()]
    assert live == [0] * len(SPEC), "every lease was released or has expired"


# --- a holder killed or paused mid-lease --------------------------------------------------


def heartbeating_holder(
    redis_url: str, pool_name: str, ttl: float, interval: float, conn: Connection
) -> None:
    """Lease, report it, then heartbeat every ``interval`` until told to report and stop."""
    pool = KeyPool(redis.Redis.from_url(redis_url), pool_name)
    lease = pool.acquire("victim", ttl, timeout=10.0)
    conn.send(lease.fence)
    beats = []
    while not conn.poll(interval):
        beats.append(pool.heartbeat(lease, ttl))
    conn.recv()
    conn.send(
        {
            "beats": beats,
            "heartbeat": pool.heartbeat(lease, ttl),
            "release": pool.release(lease),
        }
    )


def _start_victim(settings: Settings, ttl: float, interval: float) -> tuple[Any, Connection]:
    parent, child = spawn.Pipe()
    proc = spawn.Process(
        target=heartbeating_holder, args=(settings.redis_url, "victim", ttl, interval, child)
    )
    proc.start()
    assert parent.poll(60), "the holder never got its lease"
    parent.recv()
    time.sleep(ttl)  # heartbeats now carry the lease past its first TTL
    return proc, parent


def _wait_for_lease(pool: KeyPool, timeout: float) -> tuple[Lease, float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        got = pool.lease("rescuer", 10.0)
        if isinstance(got, Lease):
            return got, time.monotonic() - started
        time.sleep(0.01)
    raise AssertionError(f"the key did not come back within {timeout}s")


@pytest.mark.slow
def test_killed_holder_lease_comes_back_within_ttl(
    redis_client: redis.Redis, settings: Settings
) -> None:
    ttl, interval = 1.0, 0.3
    pool = KeyPool(redis_client, "victim")
    pool.sync([KeySpec(1, 1)])
    proc, _ = _start_victim(settings, ttl, interval)
    assert isinstance(pool.lease("rescuer", 10.0), Busy), "the victim holds the only key"
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    _, waited = _wait_for_lease(pool, ttl + interval + 2.0)
    assert waited <= ttl + interval, f"reclaimed after {waited:.3f}s"
    assert waited >= 0.3, "the heartbeated lease was not taken away early"


@pytest.mark.slow
def test_paused_holder_cannot_touch_the_lease_it_lost(
    redis_client: redis.Redis, settings: Settings
) -> None:
    ttl, interval = 0.6, 0.15
    pool = KeyPool(redis_client, "victim")
    pool.sync([KeySpec(1, 1)])
    proc, conn = _start_victim(settings, ttl, interval)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        current, waited = _wait_for_lease(pool, ttl + 2.0)
        assert waited <= ttl + 0.5, f"reclaimed after {waited:.3f}s"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    conn.send("report")
    assert conn.poll(30)
    report = conn.recv()
    proc.join(timeout=10)
    assert report["beats"][:2] == [True, True], "before the pause the holder kept its lease"
    beats = report["beats"]
    assert True not in beats[beats.index(False) :] if False in beats else True
    assert report["heartbeat"] is False
    assert report["release"] is False
    assert isinstance(pool.lease("third", 1.0), Busy), "the stale release freed nothing"
    assert pool.heartbeat(current, 10.0), "the new holder still holds its lease"
    assert [s.live_leases for s in pool.snapshot()] == [1]
    assert proc.exitcode == 0
