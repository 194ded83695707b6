"""Token budgets on real workers against the loopback AI-API service, whose own counts are the
oracle: more calls are asked for than the keys' budgets allow in a minute, and still no call is
answered 429 and no key goes over its tokens per minute in any window; the refunds of what the
calls did not use let more calls through than their reservations alone would."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine

from harvest import keystore
from harvest.app import Harvest
from harvest.loopback import LoopKey, start_loopback, window_peaks
from harvest.settings import Settings
from tests.helpers import statuses
from tests.processes.conftest import Cluster, wait_until

pytestmark = pytest.mark.slow

POOL = "token-pool"
TPM = 6000
COST = 600  # the job reserves the most a call can use; calls use 200..600 (mean 400)
JOBS = 60  # about 30 calls fit the two keys' first minute


def test_no_429_and_no_key_over_its_tpm_in_any_window(
    migrated: Settings, clean_db: Engine, effects: Engine, redis_client: redis.Redis,
    tmp_path: Path,
) -> None:  # fmt: skip
    keys = [LoopKey(f"k{i}", f"sk-tpm-{secrets.token_hex(8)}", 4, tpm=TPM) for i in range(2)]
    settings = migrated.model_copy(update={"secret_key": SecretStr(Fernet.generate_key().decode())})
    app = Harvest(settings)
    app.load_imports(["tests.jobs"])
    cipher = keystore.Cipher.from_settings(settings)
    with app.sessions.begin() as session:
        for key in keys:
            keystore.add_key(session, cipher, pool=POOL, name=key.name, secret=key.secret,
                             max_concurrency=key.concurrency, tpm=TPM)  # fmt: skip
    keystore.sync_pool(app.engine, redis_client, POOL)
    with start_loopback(keys, latency=0.05, sigma=0.0, tokens_range=(200, COST), seed=5) as api:
        cluster = Cluster(settings, tmp_path)
        cluster.env["HARVEST_SECRET_KEY"] = settings.secret_key.get_secret_value()  # type: ignore[union-attr]
        try:
            cluster.worker("schedule", concurrency=1)
            cluster.worker("execution", concurrency=1)
            cluster.beat()
            cluster.wait_ready()
            ids = app.enqueue_many("async_token_call", [{"url": f"{api.url}/v1/call"}] * JOBS)
            wait_until(
                lambda: statuses(effects, ids).get("succeeded", 0) >= 2 * TPM // COST,
                timeout=90,
                interval=0.5,
                what="the calls the budgets allow at once",
            )
            # the budgets are full: the rest wait for the window (a minute), never sent now
            seen = [-1]

            def quiet() -> bool:
                seen.append(len(api.log()))
                return seen[-1] == seen[-2]

            wait_until(quiet, timeout=30, interval=3.0, what="the calls to stop")
            stats, log, done = api.stats()["keys"], api.log(), statuses(effects, ids)
        finally:
            cluster.stop()
    app.close()
    assert sum(k["http_429"] for k in stats.values()) == 0
    for name, peak in window_peaks(log, 60.0).items():
        assert peak <= TPM, f"key {name} used {peak} tokens in one window (tpm {TPM})"
    assert all(k["peak_window_tokens_attempted"] <= TPM for k in stats.values())
    calls = Counter(e["key"] for e in log)
    assert set(calls) == {k.name for k in keys}
    # Reservations alone would allow TPM // COST calls a key; what was refunded allowed more.
    assert all(n > TPM // COST for n in calls.values()), calls
    assert done.get("succeeded", 0) == len(log) < JOBS and "failed" not in done


def test_a_worker_killed_with_50_reservations_does_not_let_the_key_over_its_tpm(
    migrated: Settings, clean_db: Engine, effects: Engine, redis_client: redis.Redis,
    tmp_path: Path,
) -> None:  # fmt: skip
    """50 calls of 600 tokens in flight on one key of 40,000 tpm when their worker is SIGKILLed:
    the service counted their 30,000 tokens. Their jobs are rescued and run again on a new
    worker, but the dead leases keep their reservations for the rest of the minute, so only
    16 more calls fit: the service never sees the key over its budget, and answers no 429."""
    tpm, calls = 40_000, 50
    key = LoopKey("k", f"sk-tpm-{secrets.token_hex(8)}", 200, tpm=tpm)
    settings = migrated.model_copy(update={"secret_key": SecretStr(Fernet.generate_key().decode())})
    app = Harvest(settings)
    app.load_imports(["tests.jobs"])
    with app.sessions.begin() as session:
        keystore.add_key(session, keystore.Cipher.from_settings(settings), pool=POOL, name="k",
                         secret=key.secret, max_concurrency=100, tpm=tpm)  # fmt: skip
    keystore.sync_pool(app.engine, redis_client, POOL)
    with start_loopback([key], latency=0.05, sigma=0.0) as api:
        cluster = Cluster(settings, tmp_path)
        cluster.env["HARVEST_SECRET_KEY"] = settings.secret_key.get_secret_value()  # type: ignore[union-attr]
        try:
            cluster.worker("schedule", concurrency=1)
            victim = cluster.worker("execution", concurrency=1)
            cluster.beat()
            cluster.wait_ready()
            slow = {"url": f"{api.url}/v1/call", "extra": {"tokens": COST, "latency": 20}}
            ids = app.enqueue_many("async_token_call", [slow] * calls)
            wait_until(
                lambda: api.stats()["keys"]["k"]["in_flight"] == calls,
                timeout=90,
                interval=0.5,
                what=f"{calls} calls in flight",
            )
            cluster.kill(victim)  # SIGKILL, the whole process group: no release, no refund
            victim.wait(10)
            cluster.worker("execution", concurrency=1)
            room = (tpm - calls * COST) // COST  # 16 calls
            wait_until(
                lambda: api.stats()["keys"]["k"]["requests"] >= calls + room,
                timeout=90,
                interval=0.5,
                what=f"{room} calls by the new worker",
            )
            time.sleep(3.0)  # the other 34 rescued jobs wait for the window: no call now
            stats, left = api.stats()["keys"]["k"], statuses(effects, ids)
        finally:
            cluster.stop()
    app.close()
    assert stats["http_429"] == 0
    assert stats["peak_window_tokens"] <= tpm and stats["peak_window_tokens_attempted"] <= tpm
    assert stats["requests"] == calls + room, "no call beyond what the budget has room for"
    assert "failed" not in left
