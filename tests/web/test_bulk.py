"""Bulk actions never widen: a filter that cannot be used is refused by pages and API alike
(one rule, harvest.web.filters), and a bulk form touches at most the count it showed."""

from __future__ import annotations

import re
from html import unescape

import httpx
import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from tests.web.conftest import csrf_token
from tests.web.helpers import db_status, end_as

LONG = "legacy." + "n" * 202  # 209 characters, as an older version could store


def _dead(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT name, count(*) FROM harvest_jobs WHERE status = 'failed' GROUP BY name")
        )
        return {r[0]: int(r[1]) for r in rows}


def _rename(engine: Engine, ids: list[int], name: str) -> None:
    """What an older version (or a hand-written INSERT) may have stored."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE harvest_jobs SET name = :n WHERE id = ANY(:ids)"),
            {"n": name, "ids": ids},
        )


def _forms(html: str, action: str) -> list[dict[str, str]]:
    """The hidden fields of every form of the page posting to ``action``, as a browser sends."""
    found = []
    for body in re.findall(rf'<form method="post" action="{action}"[^>]*>(.*?)</form>', html, re.S):
        fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', body)
        found.append({k: unescape(v) for k, v in fields})
    return found


@pytest.fixture
def four_dead(harvest: Harvest, clean_db: Engine) -> dict[str, list[int]]:
    """4 dead jobs of 3 names, one of them 209 characters long."""
    flaky = harvest.enqueue_many("web_flaky", [{"note": str(i)} for i in range(2)])
    noop = harvest.enqueue_many("web_noop", [{"n": 1}])
    long = harvest.enqueue_many("web_noop", [{"n": 2}])
    end_as(clean_db, flaky + noop + long, "failed", "RuntimeError: x")
    _rename(clean_db, long, LONG)
    return {"web_flaky": flaky, "web_noop": noop, LONG: long}


def test_delete_all_beside_a_209_character_name_deletes_that_one_job(
    http: httpx.Client, clean_db: Engine, four_dead: dict[str, list[int]]
) -> None:
    page = http.get("/dead").text
    forms = [f for f in _forms(page, "/dead/delete") if f.get("name") == LONG]
    assert len(forms) == 1 and forms[0]["count"] == "1"
    assert "Delete all 1" in page
    done = http.post("/dead/delete", data=forms[0])
    assert done.status_code == 303
    assert db_status(clean_db, four_dead[LONG][0]) is None
    assert _dead(clean_db) == {"web_flaky": 2, "web_noop": 1}  # the 3 others are left alone
    # Through the API as well, by its exact name (not trimmed, not truncated).
    retried = http.post(
        "/api/dead/retry", json={"name": "web_noop", "limit": 1},
        headers={"X-CSRF-Token": csrf_token(http)},
    )  # fmt: skip
    assert retried.json()["count"] == 1
    assert _dead(clean_db) == {"web_flaky": 2}


UNUSABLE = ["", " ", " " * 8, "\t\n", "n" * 1001, "web_flaky\x00", "\x00"]


@pytest.mark.parametrize("name", UNUSABLE, ids=repr)
def test_a_name_that_cannot_be_used_is_refused_by_pages_and_api_alike(
    http: httpx.Client, clean_db: Engine, four_dead: dict[str, list[int]], name: str
) -> None:
    token = csrf_token(http)
    before = _dead(clean_db)
    for action in ("/dead/retry", "/dead/delete"):
        page = http.post(action, data={"csrf_token": token, "name": name, "count": "4"})
        assert page.status_code == 422, (action, page.text)
        assert "invalid name" in page.text and "<html" in page.text
        api = http.post(f"/api{action}", json={"name": name}, headers={"X-CSRF-Token": token})
        assert api.status_code == 422, (action, api.text)
    assert _dead(clean_db) == before  # nothing touched
    if name:  # on pages, an empty field of the filter form means "any name"
        assert http.get("/jobs", params={"name": name}).status_code == 422
        assert http.get("/dead", params={"name": name}).status_code == 422
        assert http.get("/jobs", params={"queue": name}).status_code == 422
    assert http.get("/api/jobs", params={"name": name}).status_code == 422
    assert http.get("/api/jobs", params={"queue": name}).status_code == 422


def test_a_lone_surrogate_is_refused_not_a_server_error(
    http: httpx.Client, clean_db: Engine, four_dead: dict[str, list[int]]
) -> None:
    token = csrf_token(http)
    body = b'{"name": "web_flaky\\ud800"}'
    headers = {"X-CSRF-Token": token, "Content-Type": "application/json"}
    assert http.post("/api/dead/delete", content=body, headers=headers).status_code == 422
    assert _dead(clean_db)["web_flaky"] == 2


def test_a_bulk_form_touches_at_most_the_count_it_showed(
    harvest: Harvest, http: httpx.Client, clean_db: Engine, four_dead: dict[str, list[int]]
) -> None:
    page = http.get("/dead").text
    every = _forms(page, "/dead/retry")
    shown = next(f for f in every if f.get("name") == "web_flaky")
    everything = next(f for f in every if "name" not in f)
    assert shown["count"] == "2" and everything["count"] == "4"
    # Three more web_flaky jobs die after the page was shown.
    later = harvest.enqueue_many("web_flaky", [{"note": f"later {i}"} for i in range(3)])
    end_as(clean_db, later, "failed", "RuntimeError: later")
    done = http.post("/dead/retry", data=shown)
    assert done.status_code == 303 and "n=2" in done.headers["location"]
    assert _dead(clean_db)["web_flaky"] == 3  # 5 dead, 2 retried (the oldest)
    assert [db_status(clean_db, i) for i in four_dead["web_flaky"]] == ["pending", "pending"]
    done = http.post("/dead/delete", data={**everything, "count": "4"})
    assert "n=4" in done.headers["location"]
    assert sum(_dead(clean_db).values()) == 1  # 5 were dead: the one beyond the count is kept
    # A bulk form must carry a usable count.
    token = everything["csrf_token"]
    for count in (None, "", "0", "-1", "1.5", "x", "\u0661", "9" * 30):
        fields = {"csrf_token": token} | ({"count": count} if count is not None else {})
        refused = http.post("/dead/delete", data=fields)
        assert refused.status_code == 422 and "invalid count" in refused.text, count
    assert sum(_dead(clean_db).values()) == 1


def test_a_name_that_cannot_be_a_filter_gets_no_bulk_button(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    ids = harvest.enqueue_many("web_noop", [{"n": i} for i in range(2)])
    end_as(clean_db, ids, "failed", "RuntimeError: x")
    _rename(clean_db, ids[:1], "   ")  # only whitespace: stored by hand, or by an old version
    page = http.get("/dead").text
    assert "cannot be used as a filter" in page
    assert [f.get("name") for f in _forms(page, "/dead/delete")] == ["web_noop", None]
    # Its job is still listed, and can be deleted on its own.
    assert f'data-job-id="{ids[0]}"' in page
    token = csrf_token(http)
    assert http.post(f"/jobs/{ids[0]}/delete", data={"csrf_token": token}).status_code == 303
    assert _dead(clean_db) == {"web_noop": 1}
