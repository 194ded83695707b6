"""harvest.search.parse: what a person types, read into one condition, or refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harvest.errors import InvalidFilter
from harvest.search import InvalidSearch, Search, parse


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("42", Search(job_id=42)),
        ("  #42 ", Search(job_id=42)),
        ("id = 7", Search(job_id=7)),
        ("name = fetch_page", Search(name="fetch_page")),
        ('name = "two words "', Search(name="two words ")),
        ("fetch", Search(name_part="fetch")),
        ("payload.url = https://x.org/a?b=c", Search(payload='{"url": "https://x.org/a?b=c"}')),
        ("payload.n = 5", Search(payload='{"n": 5}')),
        ('payload.n = "5"', Search(payload='{"n": "5"}')),
        ("payload.ok = true", Search(payload='{"ok": true}')),
        ("payload.a.b.c = x y", Search(payload='{"a": {"b": {"c": "x y"}}}')),
        ("payload.big = 1e400", Search(payload='{"big": 1e400}')),  # Postgres numeric holds it
        ("payload.x = NaN", Search(payload='{"x": "NaN"}')),  # not JSON: text
        ("payload.é = ü", Search(payload='{"é": "ü"}')),
    ],
)
def test_each_form_is_read(typed: str, expected: Search) -> None:
    assert parse(typed) == expected


@pytest.mark.parametrize(
    ("typed", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("payload = x", "name a key"),
        ("payload.url =", "needs a value"),
        ("payload..url = x", "empty key"),
        ("colour = red", "unknown field 'colour'"),
        ("id = abc", "id must be a whole number"),
        ("id = 0", "id must be a whole number"),
        ("99999999999999999999", "id must be a whole number"),
        ("a\x00b", "NUL"),
        ("\ud800", "lone surrogate"),
        ("x" * 1001, "over 1000"),
        ("payload." + ".".join("k" * 33) + " = 1", "over 32"),
        ('name = "unterminated', "JSON string"),
    ],
)
def test_bad_searches_are_refused_with_a_typed_error(typed: str, says: str) -> None:
    with pytest.raises(InvalidSearch, match="search by id") as raised:
        parse(typed)
    assert says in str(raised.value)
    assert isinstance(raised.value, InvalidFilter) and raised.value.field == "q"


def test_a_name_part_is_escaped_for_ilike() -> None:
    assert Search(name_part="50%_a\\b").like == "%50\\%\\_a\\\\b%"


@given(st.text(max_size=60))
def test_any_text_is_read_or_refused_never_anything_else(typed: str) -> None:
    try:
        found = parse(typed)
    except InvalidSearch:
        return
    set_fields = [v for v in (found.job_id, found.name, found.name_part, found.payload) if v]
    assert len(set_fields) == 1
    if found.payload is not None:
        assert isinstance(json.loads(found.payload), dict)
