"""How many jobs of a key pool dispatch sends ahead of its free keys (pure)."""

from __future__ import annotations

from harvest.coordination.key_state import KeyState
from harvest.dispatcher import ahead, pool_budget


def key(live: int, max_concurrency: int = 16) -> KeyState:
    return KeyState(
        key_id=1, status="active", live_leases=live, max_concurrency=max_concurrency,
        cooldown_until=None, rate=None, rate_used=0, effective_max=max_concurrency,
    )  # fmt: skip


def test_half_the_concurrency_is_sent_ahead_at_most_512() -> None:
    assert ahead(32, run_seconds=1.0, key_wait=2.0) == 16
    assert ahead(256, run_seconds=2.0, key_wait=2.0) == 128
    assert ahead(1024, run_seconds=2.0, key_wait=2.0) == 512
    assert ahead(4096, run_seconds=None, key_wait=2.0) == 512  # no run time known yet


def test_slow_calls_get_no_more_ahead_than_keys_free_in_half_the_key_wait() -> None:
    # 1,024 slots of 30 s calls free about 34 slots a second: 512 sent ahead would wait 15 s,
    # past the 2 s key wait, and go back to pending (two writes each for nothing)
    assert ahead(1024, run_seconds=30.0, key_wait=2.0) == 35
    assert ahead(32, run_seconds=30.0, key_wait=2.0) == 2
    assert ahead(1024, run_seconds=2.0, key_wait=0.0) == 0  # no waiting at the gate: none


def test_jobs_started_and_waiting_at_the_gate_count_against_the_budget() -> None:
    keys = [key(live=16), key(live=12)]  # 4 slots free of 32, 16 sent ahead
    assert pool_budget(keys, in_flight=28, run_seconds=1.0, key_wait=2.0) == 20
    # 5 more in flight than leases: sent and not started, or started and waiting for a key
    assert pool_budget(keys, in_flight=33, run_seconds=1.0, key_wait=2.0) == 15
    assert pool_budget(keys, in_flight=60, run_seconds=1.0, key_wait=2.0) == 0


def test_while_jobs_wait_a_pool_is_topped_up_a_message_at_a_time() -> None:
    keys = [key(live=16) for _ in range(63)] + [key(live=6)]  # 10 of 1,024 slots free

    def fast(in_flight: int) -> int:  # 2 s calls: 512 sent ahead
        return pool_budget(keys, in_flight, run_seconds=2.0, key_wait=2.0, batch=16)

    assert fast(1014 + 512) == 0  # 10 < a message: wait
    assert fast(1014 + 506) == 16  # 16: one message's worth
    assert fast(0) == 522  # nothing waits: all at once
    few = [key(live=0, max_concurrency=2)]  # 1 sent ahead: any budget goes
    assert pool_budget(few, in_flight=2, run_seconds=1.0, key_wait=2.0, batch=16) == 1
