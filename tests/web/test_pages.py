"""The server-rendered pages and their forms, over HTTP (the browser tests drive the rest)."""

from __future__ import annotations

import re

import httpx
from sqlalchemy import Engine

from harvest.app import Harvest
from tests.web.conftest import csrf_token
from tests.web.helpers import db_status, end_as


def _job_ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-job-id="(\d+)"', html)]


def test_the_jobs_page_filters_and_pages_newest_first(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    noop = harvest.enqueue_many("web_noop", [{"n": i} for i in range(5)])
    bulk = harvest.enqueue_many("web_bulk", [{"n": i} for i in range(3)])
    end_as(clean_db, noop[:2], "failed", "RuntimeError: x")

    first = http.get("/jobs", params={"per_page": 3}).text
    assert _job_ids(first) == sorted(noop + bulk, reverse=True)[:3]
    older = re.search(r'<a href="([^"]+)" rel="next">', first)
    assert older is not None
    second = http.get(older.group(1).replace("&amp;", "&")).text
    assert _job_ids(second) == sorted(noop + bulk, reverse=True)[3:6]
    assert 'rel="prev"' in second

    assert _job_ids(http.get("/jobs?status=failed").text) == sorted(noop[:2], reverse=True)
    assert _job_ids(http.get("/jobs?queue=bulk").text) == sorted(bulk, reverse=True)
    assert _job_ids(http.get("/jobs?name=web_noop&status=pending").text) == sorted(
        noop[2:], reverse=True
    )
    assert http.get("/jobs?status=bogus").status_code == 422


def test_dead_job_forms_retry_all_matching_and_delete(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    flaky = harvest.enqueue_many("web_flaky", [{"note": str(i)} for i in range(3)])
    noop = harvest.enqueue_many("web_noop", [{"n": i} for i in range(2)])
    end_as(clean_db, flaky + noop, "failed", "RuntimeError: x")
    token = csrf_token(http)

    page = http.get("/dead").text
    assert "Retry all 3" in page and "Delete all 2" in page
    done = http.post("/dead/retry", data={"csrf_token": token, "name": "web_flaky", "count": "3"})
    assert done.status_code == 303
    assert done.headers["location"] == "/dead?done=retried_many&n=3&name=web_flaky"
    assert "Dead jobs sent back to pending: 3." in http.get(done.headers["location"]).text
    assert {db_status(clean_db, i) for i in flaky} == {"pending"}

    done = http.post(f"/jobs/{noop[0]}/delete", data={"csrf_token": token})
    assert done.status_code == 303 and db_status(clean_db, noop[0]) is None
    done = http.post("/dead/delete", data={"csrf_token": token, "count": "1"})
    assert done.headers["location"] == "/dead?done=deleted_many&n=1"
    assert db_status(clean_db, noop[1]) is None

    refused = http.post(f"/jobs/{flaky[0]}/delete", data={"csrf_token": token})
    assert refused.status_code == 409 and "not failed" in refused.text
    done = http.post(f"/jobs/{flaky[0]}/cancel", data={"csrf_token": token})
    assert done.status_code == 303 and db_status(clean_db, flaky[0]) == "cancelled"


def test_errors_are_pages_and_messages_are_never_taken_from_the_url(
    harvest: Harvest, http: httpx.Client
) -> None:
    missing = http.get("/jobs/424242")
    assert missing.status_code == 404 and "no job with id 424242" in missing.text
    assert "<html" in missing.text
    assert http.get("/batches/77").status_code == 404
    assert http.get("/jobs/abc").status_code == 422
    page = http.get("/keys?done=<script>alert(1)</script>&n=<b>").text
    assert "<script>alert" not in page and "alert(1)" not in page
    page = http.get("/dead?done=retried_many&n=<b>x</b>").text
    assert "Dead jobs sent back to pending: ?." in page and "<b>x" not in page


def test_a_jobs_page_and_api_show_each_attempt(http: httpx.Client, harvest: Harvest) -> None:
    """A job that failed three times shows three attempts, oldest first: two retries and the
    failure, each with its worker, times and error (page and API)."""
    from harvest.testing import run_pending

    ref = harvest.enqueue("web_three_tries")
    run_pending(harvest)
    page = http.get(f"/jobs/{ref.id}").text
    rows = re.findall(r'<tr data-attempt="(\d+)">(.*?)</tr>', page, re.S)
    assert [n for n, _ in rows] == ["1", "2", "3"]
    assert ["retry" in r for _, r in rows] == [True, True, False]
    assert "failed" in rows[2][1] and "try 3 failed" in rows[2][1]
    attempts = http.get(f"/api/jobs/{ref.id}/attempts").json()
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [
        (1, "retry"), (2, "retry"), (3, "failed"),
    ]  # fmt: skip
    assert all(a["worker"] and a["started_at"] and a["seconds"] >= 0 for a in attempts)
    assert "try 2 failed" in attempts[1]["error"]
    assert http.get("/api/jobs/987654/attempts").status_code == 404


def test_head_answers_like_get_without_a_body(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    ref = harvest.enqueue("web_noop", {"n": 1})
    for path in ["/", "/jobs", f"/jobs/{ref.id}", "/dead", "/keys", "/api/jobs", "/api/dead"]:
        got = http.get(path)
        head = http.head(path)
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert "content-length" in head.headers, path
        assert head.headers["content-security-policy"] == got.headers["content-security-policy"]
    assert http.head("/jobs/424242").status_code == 404
    assert http.head(f"/jobs/{ref.id}/retry").status_code == 405  # a POST-only action
    assert http.head("/jobs", auth=("operator", "wrong-password")).status_code == 401
    assert db_status(clean_db, ref.id) == "pending"


def test_the_favicon_is_served(http: httpx.Client) -> None:
    got = http.get("/favicon.ico")
    assert got.status_code == 200 and got.headers["content-type"].startswith("image/svg+xml")
    assert 'rel="icon"' in http.get("/").text


def test_job_lists_split_by_what_an_operator_asks(http: httpx.Client, harvest: Harvest) -> None:
    """ready (due), scheduled (not due, never tried), retrying (waiting for its next attempt,
    with its last error), running (dispatched or running), dead: page tabs and API alike."""
    from harvest import store
    from harvest.testing import run_pending

    retrying = harvest.enqueue("web_three_tries").id
    run_pending(harvest, retries=False)  # one failed attempt: pending again, after its backoff
    dead = harvest.enqueue("web_flaky", {"note": "x"}).id
    run_pending(harvest, retries=False)  # one attempt allowed: dead
    scheduled = harvest.enqueue("web_noop", {"n": 1}, delay=3600).id
    running = harvest.enqueue("web_noop", {"n": 2}).id
    with harvest.engine.begin() as conn:
        assert [c.id for c in store.claim_due(conn, limit=10, ttl=60)] == [running]
    ready = harvest.enqueue("web_noop", {"n": 3}).id

    def listed(state: str) -> list[int]:
        got = http.get("/api/jobs", params={"state": state})
        assert got.status_code == 200
        return [j["id"] for j in got.json()["jobs"]]

    assert listed("ready") == [ready]
    assert listed("scheduled") == [scheduled]
    assert listed("retrying") == [retrying]
    assert listed("running") == [running]
    assert listed("dead") == [dead]
    page = http.get("/jobs", params={"state": "retrying"}).text
    assert _job_ids(page) == [retrying] and "try 1 failed" in page
    assert 'data-field="run-at">in ' in page  # when its next attempt is due
    assert re.search(r'data-field="run-at">in (59|60)m<', http.get("/jobs?state=scheduled").text)
    assert http.get("/jobs?state=bogus").status_code == 422
