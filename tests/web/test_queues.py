"""The Queues page and its API against the running dashboard: counts as the database holds
them, pause and resume (CSRF-checked) kept in Postgres, bad names refused (422 / 404)."""

from __future__ import annotations

import re

import httpx
from sqlalchemy import Engine, text

from harvest.app import Harvest
from tests.web.conftest import csrf_token


def _paused(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT queue FROM harvest_queue_pauses")).scalars())


def test_the_api_lists_pauses_and_resumes_queues(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    harvest.enqueue_many("web_bulk", [{"n": i} for i in range(4)])
    harvest.enqueue("web_noop", {"n": 1}, delay=3600)
    listed = {q["name"]: q for q in http.get("/api/queues").json()}
    assert listed["bulk"] | {"paused_at": None} == {
        "name": "bulk", "pending": 4, "ready": 4, "running": 0, "paused": False,
        "paused_at": None,
    }  # fmt: skip
    assert (listed["execution"]["pending"], listed["execution"]["ready"]) == (1, 0)

    assert http.post("/api/queues/bulk/pause").status_code == 403  # no CSRF token
    assert _paused(clean_db) == []
    headers = {"X-CSRF-Token": csrf_token(http)}
    paused = http.post("/api/queues/bulk/pause", headers=headers)
    assert paused.status_code == 200, paused.text
    assert paused.json()["paused"] is True and paused.json()["changed"] is True
    assert http.post("/api/queues/bulk/pause", headers=headers).json()["changed"] is False
    assert _paused(clean_db) == ["bulk"]
    assert {q["name"]: q["paused"] for q in http.get("/api/queues").json()} == {
        "bulk": True, "execution": False,
    }  # fmt: skip

    resumed = http.post("/api/queues/bulk/resume", headers=headers)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    assert _paused(clean_db) == []


def test_bad_queue_names_are_refused_and_nothing_is_stored(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    harvest.enqueue("web_bulk", {"n": 1})
    headers = {"X-CSRF-Token": csrf_token(http)}
    unknown = http.post("/api/queues/nowhere/pause", headers=headers)
    assert unknown.status_code == 404 and "unknown queue 'nowhere'" in unknown.json()["detail"]
    for bad in ("%20%20", "a%09b", "x" * 201):
        response = http.post(f"/api/queues/{bad}/pause", headers=headers)
        assert response.status_code == 422, (bad, response.text)
    form = http.post("/queues/pause", data={"csrf_token": headers["X-CSRF-Token"], "queue": " "})
    assert form.status_code == 400 and "invalid queue" in form.text
    missing = http.post("/queues/pause", data={"csrf_token": headers["X-CSRF-Token"]})
    assert missing.status_code == 400
    assert _paused(clean_db) == []


def test_the_page_shows_counts_and_pauses_with_its_form(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    harvest.enqueue_many("web_bulk", [{"n": i} for i in range(3)])
    page = http.get("/queues")
    assert page.status_code == 200
    row = re.search(r'<tr data-queue="bulk">.*?</tr>', page.text, re.S)
    assert row is not None
    assert '<td data-field="pending">3</td>' in row.group(0)
    assert 'data-field="state"' in row.group(0) and ">active<" in row.group(0)
    token = csrf_token(http)
    done = http.post("/queues/pause", data={"csrf_token": token, "queue": "bulk"})
    assert done.status_code == 303 and done.headers["location"] == "/queues?done=queue_paused"
    assert _paused(clean_db) == ["bulk"]
    page = http.get("/queues?done=queue_paused")
    assert "Queue paused" in page.text and ">paused<" in page.text
    assert http.post("/queues/resume", data={"queue": "bulk"}).status_code == 403  # no token
    http.post("/queues/resume", data={"csrf_token": token, "queue": "bulk"})
    assert _paused(clean_db) == []
