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
    done = http.post("/dead/retry", data={"csrf_token": token, "name": "web_flaky"})
    assert done.status_code == 303
    assert done.headers["location"] == "/dead?done=retried_many&n=3&name=web_flaky"
    assert "Dead jobs sent back to pending: 3." in http.get(done.headers["location"]).text
    assert {db_status(clean_db, i) for i in flaky} == {"pending"}

    done = http.post(f"/jobs/{noop[0]}/delete", data={"csrf_token": token})
    assert done.status_code == 303 and db_status(clean_db, noop[0]) is None
    done = http.post("/dead/delete", data={"csrf_token": token})
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
