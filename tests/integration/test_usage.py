"""Usage accounting against the loopback AI-API service, whose own counts are the oracle: jobs
run in-process (the Runner, sync and async handlers) through a pool of keys, one of which
really admits fewer calls at once than it declares (429s) on a service that answers some calls
500 (errors). What harvest wrote to Postgres per key and per pool matches the service's counts
within 1 %, and the dashboard's JSON API and the metrics show the same figures."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from cryptography.fernet import Fernet
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import Engine, text

from harvest import keystore
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.loopback import LoopbackHandle, LoopKey, start_loopback
from harvest.metrics import USAGE, registry_for
from harvest.retry import RetryPolicy
from harvest.runner import Runner
from harvest.settings import Settings
from harvest.usage import rows
from harvest.web import auth
from harvest.web.app import create_app
from tests.helpers import body, claim_all
from tests.web.conftest import USER, Server

POOL = "usage-pool"
FAST = RetryPolicy(base=0.01, factor=1.0, max_delay=0.05, jitter=0.0)
JOBS = 120
KEYS = [
    LoopKey("a", f"sk-usage-{secrets.token_hex(8)}", 4),
    LoopKey("b", f"sk-usage-{secrets.token_hex(8)}", 4),
    LoopKey("c", f"sk-usage-{secrets.token_hex(8)}", 6, true_concurrency=2),  # 429s
]


def _answer(ctx: JobContext, response: httpx.Response) -> dict[str, Any]:
    ctx.observe(response)
    if response.status_code == 429:
        ctx.rate_limited(float(response.headers.get("Retry-After", "1")))
    response.raise_for_status()  # a 500 is an error (retried)
    ctx.used(tokens=response.json()["usage"]["total_tokens"])
    return {"ok": True}


@pytest.fixture
def service() -> Iterator[LoopbackHandle]:
    with start_loopback(KEYS, latency=0.05, sigma=0.3, error_rate=0.1,
                        tokens_range=(100, 900), seed=17) as handle:  # fmt: skip
        yield handle


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    settings = migrated.model_copy(
        update={"secret_key": SecretStr(Fernet.generate_key().decode()), "key_wait": 0.5}
    )
    harvest = Harvest(settings, redis_client=redis_client)
    cipher = keystore.Cipher.from_settings(settings)
    with harvest.sessions.begin() as session:
        for key in KEYS:
            keystore.add_key(session, cipher, pool=POOL, name=key.name, secret=key.secret,
                             max_concurrency=key.concurrency)  # fmt: skip
    keystore.sync_pool(harvest.engine, redis_client, POOL)

    @harvest.job("use_async", pool=POOL, max_attempts=3, retry=FAST)
    async def use_async(ctx: JobContext, url: str) -> dict[str, Any]:
        async with ctx.aclient() as http:
            response = await http.post(url, json={"job": ctx.job_id, "attempt": ctx.attempt})
        return _answer(ctx, response)

    @harvest.job("use_sync", pool=POOL, max_attempts=3, retry=FAST)
    def use_sync(ctx: JobContext, url: str) -> dict[str, Any]:
        with ctx.client() as http:
            response = http.post(url, json={"job": ctx.job_id, "attempt": ctx.attempt})
        return _answer(ctx, response)

    yield harvest
    harvest.close()


def run_all(app: Harvest, runner: Runner, engine: Engine, ids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        claimed = claim_all(engine)
        if claimed:
            runner.execute(body(claimed))
            continue
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT count(*) FROM harvest_jobs WHERE id = ANY(:ids) AND status IN "
                     "('pending', 'dispatched', 'running')"), {"ids": ids},
            ).scalar_one()  # fmt: skip
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"jobs still running after {timeout}s")


def near(ours: int, theirs: int) -> bool:
    return abs(ours - theirs) <= max(theirs, 1) * 0.01


def test_usage_per_key_and_pool_matches_the_services_counts(
    app: Harvest, runner: Runner, engine: Engine, service: LoopbackHandle
) -> None:
    url = f"{service.url}/v1/call"
    tenant_of = {}  # the jobs' tenants: a third each of acme, globex and none
    for i in range(JOBS + JOBS // 4):
        tenant = ("acme", "globex", None)[i % 3]
        name = "use_async" if i < JOBS else "use_sync"
        tenant_of[app.enqueue(name, {"url": url}, tenant=tenant).id] = tenant
    ids = list(tenant_of)
    run_all(app, runner, engine, ids, timeout=120)
    runner.usage.flush()
    stats, log = service.stats()["keys"], service.log()
    answered = Counter[str]()
    for e in log:
        if e["status"] == 200:  # tokens the service told harvest of (a 500 says none)
            answered[e["key"]] += e["tokens"]
    with engine.connect() as conn:
        keys = {f.key: f for f in rows.per_key(conn, minutes=10)}
        totals = {f.key: f for f in rows.per_key(conn, minutes=None)}
        pools = rows.per_minute(conn, minutes=10)
    assert set(keys) == {k.name for k in KEYS} == set(totals)
    assert stats["c"]["http_429"] > 0 and sum(s["http_500"] for s in stats.values()) > 0
    for name, theirs in stats.items():
        for ours in (keys[name], totals[name]):
            assert near(ours.requests, theirs["requests"]), (name, ours, theirs)
            assert near(ours.rate_limited, theirs["http_429"]), (name, ours, theirs)
            assert near(ours.errors, theirs["http_500"]), (name, ours, theirs)
            assert near(ours.tokens, answered[name]), (name, ours, answered)
    assert {p.pool for p in pools} == {POOL}
    assert near(sum(p.requests for p in pools), sum(s["requests"] for s in stats.values()))
    assert near(sum(p.tokens for p in pools), sum(answered.values()))
    shown = dashboard(app)
    served = scraped(engine, app)
    for name, theirs in stats.items():
        for ours in (shown[name], served[name]):
            assert near(ours["requests"], theirs["requests"]), (name, ours, theirs)
            assert near(ours["rate_limited"], theirs["http_429"]), (name, ours, theirs)
            assert near(ours["errors"], theirs["http_500"]), (name, ours, theirs)
            assert near(ours["tokens"], answered[name]), (name, ours, answered)
    assert_tenants_match(engine, app, log, tenant_of)


def assert_tenants_match(
    engine: Engine, app: Harvest, log: list[dict[str, Any]], tenant_of: dict[int, str | None]
) -> None:
    """Usage per tenant of the jobs (rows, dashboard API and page, metrics) against the
    service's own log of every call."""
    theirs: dict[str | None, Counter[str]] = {t: Counter() for t in set(tenant_of.values())}
    for e in log:
        counts = theirs[tenant_of[int(e["job"])]]
        counts["requests"] += 1
        counts["rate_limited"] += e["status"] == 429
        counts["errors"] += e["status"] == 500
        counts["tokens"] += e["tokens"] if e["status"] == 200 else 0
    with engine.connect() as conn:
        stored = {f.tenant: f for f in rows.per_tenant(conn, minutes=10)}
    password = secrets.token_urlsafe(12)
    credentials = auth.Credentials(USER, SecretStr(password))
    web = create_app(app.settings, credentials=credentials, harvest=app)
    with Server(web) as server, httpx.Client(base_url=server.url, auth=(USER, password)) as http:
        (pool,) = http.get("/api/usage", params={"minutes": 10}).raise_for_status().json()
        page = http.get("/usage", params={"minutes": 10}).text
    shown = {t["tenant"]: t for t in pool["tenants"]}
    scrape = generate_latest(registry_for(engine, app.redis)).decode()
    served: dict[str | None, dict[str, float]] = {}
    for family in text_string_to_metric_families(scrape):
        if family.name.startswith("harvest_tenant_"):
            field = family.name.removeprefix("harvest_tenant_")
            for s in family.samples:
                if s.name.endswith("_total"):
                    served.setdefault(s.labels["tenant"] or None, {})[field] = s.value
    assert set(stored) == set(shown) == set(served) == {"acme", "globex", None}
    assert 'data-tenant="acme"' in page and 'data-tenant="globex"' in page
    for tenant, counts in theirs.items():
        for field in ("requests", "rate_limited", "errors", "tokens"):
            figures = (getattr(stored[tenant], field), shown[tenant][field], served[tenant][field])
            for ours in figures:
                assert near(int(ours), counts[field]), (tenant, field, ours, counts)


def dashboard(app: Harvest) -> dict[str, dict[str, int]]:
    """Each key's figures as the dashboard's JSON API shows them; the page draws the pool."""
    password = secrets.token_urlsafe(12)
    credentials = auth.Credentials(USER, SecretStr(password))
    web = create_app(app.settings, credentials=credentials, harvest=app)
    with Server(web) as server, httpx.Client(base_url=server.url, auth=(USER, password)) as http:
        page = http.get("/usage", params={"minutes": 10})
        shown = http.get("/api/usage", params={"minutes": 10}).raise_for_status().json()
    assert page.status_code == 200 and f'id="usage-{POOL}"' in page.text
    assert f"Requests per minute, pool {POOL}" in page.text
    (pool,) = shown
    minutes = pool["minutes"]
    assert sum(m["requests"] for m in minutes) == sum(k["requests"] for k in pool["keys"])
    return {k["key"]: k for k in pool["keys"]}


def scraped(engine: Engine, app: Harvest) -> dict[str, dict[str, float]]:
    """Each key's counters as a Prometheus scrape shows them."""
    text_ = generate_latest(registry_for(engine, app.redis)).decode()
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text_):
        field = USAGE.get(family.name + "_total")
        for sample in family.samples:
            if field and sample.name.endswith("_total") and sample.labels["pool"] == POOL:
                found.setdefault(sample.labels["key"], {})[field] = sample.value
    return found
