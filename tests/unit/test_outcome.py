"""What a successful attempt stores: the handler's result, as JSON Postgres can hold, with the
leased key masked wherever the handler let it in (issue 13)."""

from __future__ import annotations

import json

from harvest.execution import outcome
from harvest.models import JobStatus

SECRET = "sk-live-0123456789abcdefWXYZ"


def test_a_result_that_returns_the_leased_key_stores_it_masked() -> None:
    result = {"key": SECRET, "nested": [{"header": f"Bearer {SECRET}"}], SECRET: 1}
    done = outcome.succeeded(result, secret=SECRET)
    assert done.status is JobStatus.SUCCEEDED and done.result_json is not None
    assert SECRET not in done.result_json
    stored = json.loads(done.result_json)
    assert stored["key"] == "sk-…WXYZ"
    assert stored["nested"][0]["header"] == "Bearer sk-…WXYZ"
    assert "sk-…WXYZ" in stored


def test_a_key_with_characters_json_escapes_is_masked_too() -> None:
    secret = 'key"with\\quotes-0123456789'
    done = outcome.succeeded({"key": secret}, secret=secret)
    assert done.result_json is not None
    assert secret not in json.loads(done.result_json)["key"]


def test_a_result_with_a_lone_surrogate_fails_the_job_instead_of_the_write() -> None:
    done = outcome.succeeded({"text": "bad \udcff byte"})
    assert done.status is JobStatus.FAILED
    assert done.error is not None and "lone surrogate" in done.error
    fine = outcome.succeeded({"text": "emoji \U0001f600 is a surrogate pair in JSON"})
    assert fine.status is JobStatus.SUCCEEDED
