"""The loopback AI-API service as its users drive it: started in its own process, called over
HTTP/1.1 keep-alive by many clients at once, read back through /_stats and /_log."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from harvest.loopback import LoopbackHandle, LoopKey, start_loopback, window_peaks

SECRET_A = "sk-loop-test-aaaaaaaaaaaaaaaaaaaa"
SECRET_B = "sk-loop-test-bbbbbbbbbbbbbbbbbbbb"


@pytest.fixture
def service() -> Iterator[LoopbackHandle]:
    keys = [LoopKey("a", SECRET_A, 4), LoopKey("b", SECRET_B, 2, rate=6, period=3.0)]
    with start_loopback(keys, latency=0.3, sigma=0.0, seed=1) as handle:
        yield handle


async def _burst(url: str, secret: str, n: int, **body: object) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=30) as http:
        calls = [
            http.post(f"{url}/v1/call", json={"job": i, "attempt": 1, **body}) for i in range(n)
        ]
        return list(await asyncio.gather(*calls))


def test_at_most_c_at_once_the_rest_429_with_an_honest_retry_after(
    service: LoopbackHandle,
) -> None:
    responses = asyncio.run(_burst(service.url, SECRET_A, 10))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 4 + [429] * 6
    waits = [float(r.headers["Retry-After"]) for r in responses if r.status_code == 429]
    assert all(0.05 < w <= 0.3 for w in waits)  # until the first of the 4 admitted calls ends
    stats = service.stats()["keys"]["a"]
    assert stats["peak_in_flight"] == 4
    assert stats["peak_attempted"] >= 5
    assert (stats["requests"], stats["ok"], stats["http_429"]) == (10, 4, 6)
    assert stats["http_429_concurrency"] == 6


def test_a_client_that_honours_retry_after_gets_in_and_is_never_over_c(
    service: LoopbackHandle,
) -> None:
    async def polite(http: httpx.AsyncClient, job: int) -> int:
        refusals = 0
        while True:
            r = await http.post(f"{service.url}/v1/call", json={"job": job, "attempt": 1})
            if r.status_code == 200:
                return refusals
            refusals += 1
            await asyncio.sleep(float(r.headers["Retry-After"]))

    async def run() -> list[int]:
        headers = {"Authorization": f"Bearer {SECRET_A}"}
        async with httpx.AsyncClient(headers=headers, timeout=30) as http:
            return list(await asyncio.gather(*(polite(http, j) for j in range(12))))

    asyncio.run(run())
    stats = service.stats()["keys"]["a"]
    assert stats["ok"] == 12
    assert stats["peak_in_flight"] == 4
    log = [e for e in service.log() if e["status"] == 200]
    assert sorted(e["job"] for e in log) == list(range(12))
    events = sorted([(e["start"], 1) for e in log] + [(e["end"], -1) for e in log])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= 4


def test_rate_window_refuses_until_the_oldest_call_leaves(service: LoopbackHandle) -> None:
    first = asyncio.run(_burst(service.url, SECRET_B, 2))
    assert [r.status_code for r in first] == [200, 200]
    started = time.monotonic()
    for _ in range(2):
        asyncio.run(_burst(service.url, SECRET_B, 2))
    refused = asyncio.run(_burst(service.url, SECRET_B, 1))[0]
    assert refused.status_code == 429
    wait = float(refused.headers["Retry-After"])
    assert 3.0 - (time.monotonic() - started) - 0.5 < wait <= 3.0
    # Retry-After-Ms is the wait rounded up to the ms; Retry-After the wait to 3 decimals
    assert int(refused.headers["Retry-After-Ms"]) >= round(wait * 1000)
    time.sleep(max(0.0, wait - 0.25))
    assert asyncio.run(_burst(service.url, SECRET_B, 1))[0].status_code == 429  # not early
    time.sleep(0.3)
    assert asyncio.run(_burst(service.url, SECRET_B, 1))[0].status_code == 200  # nor late
    stats = service.stats()["keys"]["b"]
    assert (stats["ok"], stats["http_429_rate"]) == (7, 2)


def test_unknown_key_401_and_no_secret_in_stats_or_log(service: LoopbackHandle) -> None:
    r = httpx.post(f"{service.url}/v1/call", headers={"Authorization": "Bearer sk-nope"}, json={})
    assert r.status_code == 401
    assert httpx.post(f"{service.url}/v1/call", json={}).status_code == 401
    ok = asyncio.run(_burst(service.url, SECRET_A, 1, tokens=42))[0]
    assert ok.json()["usage"] == {"total_tokens": 42}
    raw = httpx.get(f"{service.url}/_stats").text + httpx.get(f"{service.url}/_log").text
    assert SECRET_A not in raw
    assert service.stats()["unknown_key"] == 2
    assert [e["status"] for e in service.log()] == [401, 401, 200]
    assert service.log(since=2)[0]["tokens"] == 42


def test_job_and_attempt_from_headers_and_reset(service: LoopbackHandle) -> None:
    headers = {"Authorization": f"Bearer {SECRET_A}", "X-Job-Id": "77", "X-Attempt": "3"}
    assert httpx.post(f"{service.url}/v1/call", headers=headers).status_code == 200
    assert service.log()[-1]["job"] == "77"
    assert service.log()[-1]["attempt"] == "3"
    service.reset()
    assert service.log() == []
    assert service.stats()["keys"]["a"]["requests"] == 0


def test_errors_and_lognormal_latency() -> None:
    keys = [LoopKey("a", SECRET_A, 64)]
    with start_loopback(keys, latency=0.1, sigma=0.3, error_rate=0.5, seed=7) as handle:
        responses = asyncio.run(_burst(handle.url, SECRET_A, 64))
        log = handle.log()
    codes = [r.status_code for r in responses]
    assert 10 < codes.count(500) < 54
    assert set(codes) == {200, 500}
    took = sorted(e["end"] - e["start"] for e in log)
    median = took[len(took) // 2]
    assert 0.08 < median < 0.2
    assert took[-1] > took[0] * 1.3  # drawn, not fixed


def test_with_a_seed_an_item_takes_the_same_latency_whatever_the_order_of_the_calls() -> None:
    keys = [LoopKey("a", SECRET_A, 64)]

    async def calls(items: list[int], url: str) -> None:
        headers = {"Authorization": f"Bearer {SECRET_A}"}
        async with httpx.AsyncClient(headers=headers, timeout=30) as http:
            for i in items:  # one at a time: the order of the calls is the order given
                await http.post(f"{url}/v1/call", json={"job": i, "attempt": 1, "i": i})

    took = []
    for items in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4]):
        with start_loopback(keys, latency=0.05, sigma=0.8, seed=11) as handle:
            asyncio.run(calls(items, handle.url))
            took.append({e["job"]: e["end"] - e["start"] for e in handle.log()})
    first, second = took
    assert all(abs(first[i] - second[i]) < 0.01 for i in first)  # the item's own latency
    assert max(first.values()) > 1.5 * min(first.values())  # drawn per item, not one value


def test_keep_alive_many_connections_and_a_malformed_request(service: LoopbackHandle) -> None:
    responses = asyncio.run(_burst(service.url, SECRET_A, 200, latency=0.0))
    assert len(responses) == 200
    assert {r.status_code for r in responses} <= {200, 429}
    port = int(service.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    assert httpx.get(f"{service.url}/_health").json() == {"ok": True}


def test_command_line_prints_its_url_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "harvest.loopback", "--keys", "-", "--port", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b'[{"name": "k", "secret": "sk-x", "concurrency": 1}]')
    proc.stdin.close()
    try:
        url = proc.stdout.readline().decode().strip()
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/_stats").json()["keys"]["k"]["concurrency"] == 1
    finally:
        proc.terminate()
    assert proc.wait(10) == 0


def test_token_budget_429_headers_and_seeded_draws() -> None:
    keys = [LoopKey("t", SECRET_A, 16, tpm=5000, token_period=60.0)]
    with start_loopback(keys, latency=0.05, sigma=0.0, tokens_range=(200, 2000), seed=3) as h:
        responses = asyncio.run(_burst(h.url, SECRET_A, 12))
        stats = h.stats()["keys"]["t"]
        log = h.log()
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    used = [r.json()["usage"]["total_tokens"] for r in ok]
    assert all(200 <= n <= 2000 for n in used) and len(set(used)) > 1  # drawn, not fixed
    assert sum(used) <= 5000 and refused, "beyond the budget: 429"
    assert stats["http_429_tokens"] == len(refused) and stats["peak_window_tokens"] <= 5000
    assert stats["peak_window_tokens_attempted"] > 5000
    last = ok[-1].headers
    assert last["x-ratelimit-limit-tokens"] == "5000"
    assert 0 <= int(last["x-ratelimit-remaining-tokens"]) < 5000
    assert last["x-ratelimit-reset-tokens"].endswith("s")
    assert float(refused[0].headers["Retry-After"]) > 50  # the window is a minute
    assert window_peaks(log)["t"] == sum(used)
