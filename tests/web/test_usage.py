"""The Usage page and /api/usage on rows the workers' flushes wrote: a chart per pool of
requests (answered, 429, errors) and tokens per minute, each key's sums, the window bounded."""

from __future__ import annotations

import time

import httpx
from sqlalchemy import Engine

from harvest import usage
from harvest.usage import rows


def write(engine: Engine, pool: str, key_id: int, ago: float, **kind: bool) -> None:
    tally = usage.Tally()
    one = usage.call(pool, key_id, reported=300, reserved=0, limited=kind.get("limited", False),
                     error=kind.get("error", False))  # fmt: skip
    tally.add(one, at=time.time() - ago)
    with engine.begin() as conn:
        rows.add(conn, tally.take())


def test_a_chart_per_pool_and_each_keys_sums(http: httpx.Client, clean_db: Engine) -> None:
    write(clean_db, "gpt", 1, 0)
    write(clean_db, "gpt", 1, 120, limited=True)
    write(clean_db, "gpt", 2, 0, error=True)
    write(clean_db, "claude", 3, 0)
    write(clean_db, "old", 4, 3 * 3600)  # outside the window
    page = http.get("/usage", params={"minutes": 30})
    assert page.status_code == 200
    assert page.text.count('<svg class="chart"') == 4  # requests and tokens, two pools
    assert 'id="usage-gpt"' in page.text and 'id="usage-old"' not in page.text
    assert "Tokens per minute, pool claude" in page.text
    shown = http.get("/api/usage", params={"minutes": 30}).json()
    assert [p["pool"] for p in shown] == ["claude", "gpt"]
    gpt = shown[1]
    assert len(gpt["minutes"]) == 30  # minutes without calls as zeros
    assert sum(m["rate_limited"] for m in gpt["minutes"]) == 1
    keys = {k["key"]: k for k in gpt["keys"]}  # keys since deleted show as #id
    assert keys["#1"] == {"key_id": 1, "key": "#1", "requests": 2, "tokens": 600,
                          "rate_limited": 1, "errors": 0}  # fmt: skip
    assert keys["#2"]["errors"] == 1


def test_the_window_is_bounded(http: httpx.Client, clean_db: Engine) -> None:
    assert http.get("/api/usage", params={"minutes": 2000}).status_code == 422
    assert http.get("/usage", params={"minutes": 1}).status_code == 422
    assert http.get("/api/usage").json() == []
    assert "no calls with API keys" in http.get("/usage").text
