"""The JSON API against the running dashboard: the figures agree with the database, the
actions do what they say (and the key pool follows), and no secret is ever sent."""

from __future__ import annotations

import re
import secrets
from typing import Any

import httpx
from sqlalchemy import Engine

from harvest.app import Harvest
from harvest.coordination.key_pool import Busy, KeyPool
from harvest.keystore import Cipher
from tests.web.conftest import Web, add_keys, csrf_token
from tests.web.helpers import db_depth, db_status, end_as


def _post(client: httpx.Client, path: str, body: Any = None) -> httpx.Response:
    return client.post(path, headers={"X-CSRF-Token": csrf_token(client)}, json=body)


def test_overview_counts_are_the_database_counts(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    pending = harvest.enqueue_many("web_noop", [{"n": i} for i in range(6)])
    bulk = harvest.enqueue_many("web_bulk", [{"n": i} for i in range(4)])
    end_as(clean_db, pending[:2], "succeeded")
    end_as(clean_db, pending[2:3], "failed", "RuntimeError: nope")
    end_as(clean_db, bulk[:1], "succeeded")
    harvest.cancel(bulk[1])

    body = http.get("/api/overview").json()
    shown = {(d["queue"], d["status"]): d["jobs"] for d in body["depth"]}
    assert shown == db_depth(clean_db)
    assert shown == {
        ("execution", "pending"): 3,
        ("execution", "succeeded"): 2,
        ("execution", "failed"): 1,
        ("bulk", "pending"): 2,
        ("bulk", "succeeded"): 1,
        ("bulk", "cancelled"): 1,
    }
    assert body["by_status"]["pending"] == 5
    assert body["last_minute"]["succeeded"] == 3
    assert body["last_minute"]["failed"] == 1
    assert body["last_minute"]["run_seconds"]["p50"] >= 0
    assert len(body["minutes"]) == 30
    assert body["minutes"][-1]["succeeded"] == 3


def test_jobs_are_filtered_and_paginated_newest_first(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    noop = harvest.enqueue_many("web_noop", [{"n": i} for i in range(7)])
    bulk = harvest.enqueue_many("web_bulk", [{"n": i} for i in range(5)])
    end_as(clean_db, noop[:3], "failed", "boom")
    every = sorted(noop + bulk, reverse=True)

    seen: list[int] = []
    query: dict[str, Any] = {"per_page": 5}
    while True:
        page = http.get("/api/jobs", params=query).json()
        seen += [j["id"] for j in page["jobs"]]
        if page["older"] is None:
            break
        query = {"per_page": 5, "before": page["older"]}
    assert seen == every

    back = http.get("/api/jobs", params={"per_page": 5, "after": every[5]}).json()
    assert [j["id"] for j in back["jobs"]] == every[:5]
    assert back["newer"] is None

    def ids(**params: Any) -> list[int]:
        return [j["id"] for j in http.get("/api/jobs", params=params).json()["jobs"]]

    assert ids(status="failed") == sorted(noop[:3], reverse=True)
    assert ids(queue="bulk") == sorted(bulk, reverse=True)
    assert ids(name="web_noop", status="pending") == sorted(noop[3:], reverse=True)
    assert http.get("/api/jobs", params={"status": "nonsense"}).status_code == 422


def test_job_detail_carries_payload_error_and_traceback(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    ref = harvest.enqueue("web_flaky", {"note": "<b>not html</b>"})
    end_as(clean_db, [ref.id], "failed", "RuntimeError: upstream said <no>")
    body = http.get(f"/api/jobs/{ref.id}").json()
    assert body["payload"] == {"note": "<b>not html</b>"}
    assert body["last_error"] == "RuntimeError: upstream said <no>"
    assert body["last_traceback"].startswith("Traceback")
    page = http.get(f"/jobs/{ref.id}").text
    assert "&lt;b&gt;not html&lt;/b&gt;" in page and "<b>not html" not in page
    assert "upstream said &lt;no&gt;" in page
    assert http.get("/api/jobs/999999").status_code == 404


def test_dead_jobs_retry_one_retry_all_matching_and_delete(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    flaky = harvest.enqueue_many("web_flaky", [{"note": str(i)} for i in range(4)])
    noop = harvest.enqueue_many("web_noop", [{"n": i} for i in range(3)])
    end_as(clean_db, flaky + noop, "failed", "RuntimeError: down")
    assert http.get("/api/dead").json() == {"total": 7, "by_name": {"web_flaky": 4, "web_noop": 3}}

    assert _post(http, f"/api/jobs/{flaky[0]}/retry").json()["ok"] is True
    assert db_status(clean_db, flaky[0]) == "pending"
    again = _post(http, f"/api/jobs/{flaky[0]}/retry")
    assert again.status_code == 409 and "pending" in again.json()["detail"]

    assert _post(http, f"/api/jobs/{flaky[1]}/delete").json()["ok"] is True
    assert db_status(clean_db, flaky[1]) is None
    assert _post(http, f"/api/jobs/{flaky[0]}/delete").status_code == 409  # pending: kept

    assert _post(http, "/api/dead/retry", {"name": "web_flaky"}).json()["count"] == 2
    assert [db_status(clean_db, i) for i in flaky[2:]] == ["pending", "pending"]
    assert _post(http, "/api/dead/delete", {"name": "web_noop"}).json()["count"] == 3
    assert all(db_status(clean_db, i) is None for i in noop)
    assert http.get("/api/dead").json() == {"total": 0, "by_name": {}}


def test_a_key_disabled_through_the_api_is_never_leased(
    harvest: Harvest, http: httpx.Client, cipher: Cipher
) -> None:
    keys = add_keys(harvest, cipher, "api-pool", {"k1": "sk-" + "a" * 40, "k2": "sk-" + "b" * 40})
    pool = KeyPool(harvest.redis, "api-pool")

    def leased(rounds: int = 20) -> set[int]:
        ids: set[int] = set()
        for _ in range(rounds):
            got = pool.lease_many("test", 5.0, 4)
            assert not isinstance(got, Busy)
            ids |= {lease.key_id for lease in got}
            for lease in got:
                pool.release(lease)
        return ids

    assert leased() == {keys["k1"].id, keys["k2"].id}
    assert _post(http, f"/api/keys/{keys['k2'].id}/disable").json()["ok"] is True
    assert leased() == {keys["k1"].id}
    listed = http.get("/api/keys").json()["pools"][0]
    assert {k["name"]: k["status"] for k in listed["keys"]} == {"k1": "active", "k2": "disabled"}
    assert listed["capacity"] == 2
    assert _post(http, f"/api/keys/{keys['k2'].id}/enable").json()["ok"] is True
    assert leased() == {keys["k1"].id, keys["k2"].id}
    assert _post(http, "/api/keys/424242/disable").status_code == 404


def test_schedules_pause_and_resume(harvest: Harvest, http: httpx.Client) -> None:
    made = harvest.schedule("web-hourly", "web_noop", cron="0 * * * *", payload={"n": 1})
    listed = http.get("/api/schedules").json()
    assert [(s["name"], s["enabled"]) for s in listed] == [("web-hourly", True)]
    assert _post(http, f"/api/schedules/{made.id}/pause").json()["enabled"] is False
    assert harvest.get_schedule("web-hourly").enabled is False
    resumed = _post(http, f"/api/schedules/{made.id}/resume").json()
    assert resumed["enabled"] is True and resumed["next_run_at"]
    assert _post(http, "/api/schedules/999/pause").status_code == 404


def test_batches_show_progress(harvest: Harvest, http: httpx.Client, clean_db: Engine) -> None:
    ref = harvest.enqueue_batch(
        [("web_noop", {"n": i}) for i in range(4)], on_complete="web_batch_done"
    )
    end_as(clean_db, ref.job_ids[:3], "succeeded")
    (listed,) = http.get("/api/batches").json()
    assert (listed["id"], listed["total"], listed["succeeded"], listed["pending"]) == (
        ref.id, 4, 3, 1,
    )  # fmt: skip
    end_as(clean_db, ref.job_ids[3:], "failed", "x")
    one = http.get(f"/api/batches/{ref.id}").json()
    assert one["complete"] is True and one["failed"] == 1 and one["callback_job_id"]
    page = http.get(f"/batches/{ref.id}").text
    assert all(f'data-job-id="{i}"' in page for i in ref.job_ids)


def test_a_sentinel_secret_never_appears_in_any_page_or_api_response(
    web: Web, harvest: Harvest, cipher: Cipher, clean_db: Engine
) -> None:
    sentinel = f"sk-SENTINEL{secrets.token_hex(20)}"
    keys = add_keys(harvest, cipher, "sentinel-pool", {"sentinel-key": sentinel})
    ref = harvest.enqueue("web_flaky", {"note": "x"})
    end_as(clean_db, [ref.id], "failed", "RuntimeError: down")
    batch = harvest.enqueue_batch([("web_noop", {})])
    made = harvest.schedule("web-sentinel", "web_noop", every=3600)
    key_id = keys["sentinel-key"].id
    ids = {"job_id": ref.id, "key_id": key_id, "batch_id": batch.id, "schedule_id": made.id}

    seen: list[str] = []
    with web.client() as client:
        document = client.get("/api/openapi.json").json()
        gets = ["/", "/jobs", f"/jobs/{ref.id}", "/dead", "/keys", "/schedules", "/batches",
                f"/batches/{batch.id}", "/jobs?status=failed", "/static/app.css",
                "/api/openapi.json", "/no/such/page", "/api/jobs/0"]  # fmt: skip
        gets += [_fill(path, ids) for path, ops in document["paths"].items() if "get" in ops]
        for path in gets:
            response = client.get(path)
            assert response.status_code < 500, path
            seen.append(response.text + str(response.headers))
        token = csrf_token(client)
        for path in [f"/api/keys/{key_id}/disable", f"/api/keys/{key_id}/enable"]:
            response = client.post(path, headers={"X-CSRF-Token": token})
            assert response.status_code == 200
            seen.append(response.text + str(response.headers))
        response = client.post(f"/keys/{key_id}/disable", data={"csrf_token": token})
        seen.append(response.text + client.get("/keys").text)
    everything = "\n".join(seen)
    assert keys["sentinel-key"].hint in everything  # the keys were shown: masked
    assert sentinel not in everything
    assert sentinel[3:-4] not in everything
    assert not re.search(sentinel[11:31], everything)


def _fill(path: str, ids: dict[str, int]) -> str:
    for name, value in ids.items():
        path = path.replace("{" + name + "}", str(value))
    return path
