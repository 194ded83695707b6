"""Search on /jobs and /api/jobs?q=: finds jobs by id, name and payload path, together with
the other filters; a search that cannot be read is a 422 naming the forms, never a 500."""

from __future__ import annotations

import httpx
from sqlalchemy import Engine

from harvest.app import Harvest


def test_the_api_finds_jobs_by_each_form(harvest: Harvest, http: httpx.Client) -> None:
    a = harvest.enqueue("web_flaky", {"note": "https://x.org/a"}).id
    b = harvest.enqueue("web_flaky", {"note": "https://x.org/b"}, delay=600).id
    n = harvest.enqueue("web_noop", {"n": 5}).id

    def ids(**params: str) -> list[int]:
        response = http.get("/api/jobs", params=params)
        assert response.status_code == 200, response.text
        return [j["id"] for j in response.json()["jobs"]]

    assert ids(q="payload.note = https://x.org/a") == [a]
    assert ids(q="payload.n = 5") == [n]
    assert ids(q=f"#{b}") == [b]
    assert ids(q="name = web_flaky") == [b, a]
    assert ids(q="flaky", state="scheduled") == [b]
    assert ids(q="payload.note = https://x.org/b", queue="bulk") == []


def test_an_unreadable_search_is_a_422_never_a_500(
    harvest: Harvest, http: httpx.Client, clean_db: Engine
) -> None:
    harvest.enqueue("web_noop", {"n": 1})
    for bad in ("colour = red", "payload = x", "payload..a = 1", "id = -3", " ", "x" * 1001):
        api = http.get("/api/jobs", params={"q": bad})
        assert api.status_code == 422, (bad, api.text)
        page = http.get("/jobs", params={"q": bad})
        assert page.status_code == 422, (bad, page.text[:300])
        assert "Traceback" not in page.text
    assert "unknown field" in http.get("/api/jobs", params={"q": "colour = red"}).text
    page = http.get("/jobs", params={"q": ""})  # an empty box: no search
    assert page.status_code == 200
