"""Checks at the door: what enqueue refuses, with an error that names the problem."""

from __future__ import annotations

import inspect
import json
import types
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from harvest import validation
from harvest.errors import EnqueueError, InvalidOption, InvalidPayload, PayloadTooLarge
from harvest.validation import check_signature

LIMIT = 256 * 1024


def nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def nested_dicts(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# --- encode_payload -------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.text(
                alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=30,
)
json_objects = st.dictionaries(
    st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))),
    json_values,
    max_size=6,
)


@given(json_objects)
def test_any_json_object_is_encoded_as_itself(payload: dict[str, Any]) -> None:
    encoded = validation.encode_payload(payload, limit=10**9)
    assert json.loads(encoded) == payload


@pytest.mark.parametrize("payload", [[1, 2], "text", 3, None, (("a", 1),)])
def test_payload_must_be_an_object(payload: Any) -> None:
    with pytest.raises(InvalidPayload, match="must be a JSON object") as info:
        validation.encode_payload(payload, limit=LIMIT)
    assert type(payload).__name__ in str(info.value)


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ({"tags": {"a", "b"}}, "set at payload.tags"),
        ({"handle": object()}, "object at payload.handle"),
        ({"raw": b"bytes"}, "bytes at payload.raw"),
        ({"when": datetime(2024, 1, 1, tzinfo=UTC)}, "datetime at payload.when"),
        ({"amount": Decimal("1.5")}, "Decimal at payload.amount"),
        ({"x": [1, {"ratio": float("nan")}]}, "nan at payload.x[1].ratio"),
        ({"x": float("inf")}, "inf at payload.x"),
        ({"x": float("-inf")}, "-inf at payload.x"),
    ],
)
def test_non_json_values_are_refused_and_located(payload: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidPayload) as info:
        validation.encode_payload(payload, limit=LIMIT)
    assert named in str(info.value)
    assert "JSON" in str(info.value)


def test_non_string_key_is_refused() -> None:
    with pytest.raises(InvalidPayload, match=r"key 1 at payload.d is not a string"):
        validation.encode_payload({"d": {1: "one"}}, limit=LIMIT)


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"name": "a\x00b"}, "payload.name"),
        ({"d": {"k\x00": 1}}, "payload.d"),
        ({"l": ["\x00"]}, "payload.l[0]"),
    ],
)
def test_nul_character_is_refused(payload: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidPayload, match="NUL character") as info:
        validation.encode_payload(payload, limit=LIMIT)
    assert where in str(info.value)


def test_lone_surrogate_is_refused_before_postgres_sees_it() -> None:
    """Postgres jsonb refuses the escape "\\ud800" ("Unicode low surrogate must follow a high
    surrogate"); the door must say so, not let a DataError escape from the INSERT."""
    with pytest.raises(InvalidPayload) as info:
        validation.encode_payload({"text": "broken \ud800 half"}, limit=LIMIT)
    assert "payload.text" in str(info.value)


@pytest.mark.parametrize("build", [nested_lists, nested_dicts])
def test_too_deep_is_invalid_payload_not_recursion_error(build: Any) -> None:
    payload = {"deep": build(10_000)}
    with pytest.raises(InvalidPayload, match=f"nested deeper than {validation.MAX_DEPTH} levels"):
        validation.encode_payload(payload, limit=10**9)


# Anything a caller might pass, refusable or not: the quick check must agree with the exact one.
any_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, -(2**63)])
    | st.sampled_from([4299, 4300, 4400]).map(lambda digits: 10**digits)  # Python reads 4,300
    | st.floats()  # nan and infinities too
    | st.text()  # NUL and lone surrogates too
    | st.sampled_from([Decimal("1.5"), b"raw", {1, 2}, datetime(2024, 1, 1, tzinfo=UTC)]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text() | st.integers() | st.none(), children, max_size=4)
        | st.dictionaries(st.text(), children, max_size=4).map(types.MappingProxyType)
    ),
    max_leaves=20,
)


def verdict(check: Any, payload: Any) -> Any:
    try:
        return check(payload)
    except InvalidPayload as exc:
        return str(exc)


@given(st.dictionaries(st.text(), any_values, max_size=4))
@example({"big": [10**4300]})
@example({"x": {"y": float("-inf")}})
@example({"k": {"\x00": 1}})
@example({"k": ["\ud800"]})
def test_the_quick_check_agrees_with_the_exact_one(payload: dict[str, Any]) -> None:
    """The quick check (no path built for every key) must accept, refuse and mark large floats
    exactly as the exact check does, and a refusal must carry the exact check's message."""
    exact = verdict(lambda p: validation._check_values(p, 0, "payload"), payload)
    assert verdict(validation.check_values, payload) == exact


@pytest.mark.parametrize("wrap", [lambda v: [v], lambda v: {"a": v}], ids=["lists", "dicts"])
@pytest.mark.parametrize("leaf", [[], "x", 1.5e20])
def test_nesting_up_to_the_limit_is_accepted_and_one_more_is_refused(wrap: Any, leaf: Any) -> None:
    value = leaf
    for _ in range(validation.MAX_DEPTH - 1):
        value = wrap(value)
    payload = {"deep": value}  # the leaf MAX_DEPTH levels below the payload
    assert json.loads(validation.encode_payload(payload, limit=10**9)) == payload
    with pytest.raises(InvalidPayload, match="nested deeper"):
        validation.encode_payload({"deep": wrap(value)}, limit=10**9)


def test_a_cycle_is_refused_not_recursed() -> None:
    looped: dict[str, Any] = {}
    looped["self"] = looped
    with pytest.raises(InvalidPayload, match="nested deeper"):
        validation.encode_payload(looped, limit=LIMIT)


def test_reasonable_nesting_is_accepted() -> None:
    payload = {"deep": nested_lists(50), "tree": nested_dicts(50)}
    assert json.loads(validation.encode_payload(payload, limit=LIMIT)) == payload


def test_mapping_that_is_not_a_dict_is_encoded() -> None:
    """enqueue takes ``Mapping[str, Any]``; a read-only mapping must not end in a TypeError."""
    payload = types.MappingProxyType({"a": 1, "b": types.MappingProxyType({"c": [2]})})
    assert json.loads(validation.encode_payload(payload, limit=LIMIT)) == {"a": 1, "b": {"c": [2]}}


def test_tuples_are_json_lists() -> None:
    assert validation.encode_payload({"t": (1, 2)}, limit=LIMIT) == '{"t":[1,2]}'


def test_oversize_payload_carries_size_and_limit() -> None:
    payload = {"blob": "x" * LIMIT}
    size = len(json.dumps(payload, separators=(",", ":")).encode())
    with pytest.raises(PayloadTooLarge) as info:
        validation.encode_payload(payload, limit=LIMIT)
    assert info.value.size == size
    assert info.value.limit == LIMIT
    assert f"{size} bytes" in str(info.value)
    assert f"limit of {LIMIT} bytes" in str(info.value)
    assert isinstance(info.value, InvalidPayload)


def test_payload_of_exactly_the_limit_is_accepted() -> None:
    overhead = len('{"blob":""}')
    payload = {"blob": "x" * (LIMIT - overhead)}
    assert len(validation.encode_payload(payload, limit=LIMIT).encode()) == LIMIT
    with pytest.raises(PayloadTooLarge):
        validation.encode_payload({"blob": "x" * (LIMIT - overhead + 1)}, limit=LIMIT)


def test_size_counts_utf8_bytes_not_characters() -> None:
    payload = {"s": "é" * 1000}  # 1000 characters, but more than 1000 bytes as stored
    with pytest.raises(PayloadTooLarge) as info:
        validation.encode_payload(payload, limit=1500)
    assert info.value.size > 1500


# --- check_signature ------------------------------------------------------------------------


def handler(ctx: Any, url: str, retries: int = 3) -> None:
    return None


def test_payload_that_fits_the_handler_is_accepted() -> None:
    validation.check_signature(handler, {"url": "https://example.org"})
    validation.check_signature(handler, {"url": "u", "retries": 1})


@pytest.mark.parametrize(
    ("payload", "named"),
    [({}, "url"), ({"url": "u", "colour": "red"}, "colour"), ({"retries": 1}, "url")],
)
def test_payload_that_does_not_fit_the_handler_is_refused(
    payload: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidPayload, match="does not fit the handler's parameters") as info:
        validation.check_signature(handler, payload)
    assert named in str(info.value)


# --- options --------------------------------------------------------------------------------


def assert_option_error(exc: InvalidOption, option: str, *fragments: str) -> None:
    assert exc.option == option
    assert isinstance(exc, EnqueueError)
    message = str(exc)
    assert f"invalid {option}" in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("priority", [-1000, 0, 1000])
def test_priority_in_range_is_accepted(priority: int) -> None:
    assert validation.check_priority(priority) == priority


@pytest.mark.parametrize("priority", [1001, -1001, 10**9, 1.5, "1", None, True])
def test_bad_priority_is_refused(priority: Any) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_priority(priority)
    assert_option_error(info.value, "priority", "-1000 to 1000", repr(priority))


@pytest.mark.parametrize(
    ("delay", "seconds"), [(None, None), (0, 0.0), (1.5, 1.5), (timedelta(minutes=2), 120.0)]
)
def test_good_delay_is_seconds(delay: Any, seconds: float | None) -> None:
    assert validation.check_delay(delay) == seconds


@pytest.mark.parametrize("delay", [-1, -0.001, timedelta(seconds=-1)])
def test_negative_delay_is_refused(delay: Any) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_delay(delay)
    assert_option_error(info.value, "delay", "must not be negative")


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), "5", True, [1]])
def test_delay_that_is_not_seconds_is_refused(delay: Any) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_delay(delay)
    assert_option_error(info.value, "delay", "seconds or a timedelta")


def test_aware_run_at_is_kept_as_the_same_instant_in_utc() -> None:
    when = datetime(2030, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    kept = validation.check_run_at(when)
    assert kept == when
    assert kept is not None and kept.utcoffset() == timedelta(0)
    assert validation.check_run_at(None) is None


def test_naive_run_at_is_refused() -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_run_at(datetime(2030, 1, 1, 12))
    assert_option_error(info.value, "run_at", "timezone-aware")


@pytest.mark.parametrize("run_at", [date(2030, 1, 1), "2030-01-01T00:00:00Z", 1_900_000_000.0])
def test_run_at_that_is_not_a_datetime_is_refused(run_at: Any) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_run_at(run_at)
    assert_option_error(info.value, "run_at", "must be a datetime", type(run_at).__name__)


@pytest.mark.parametrize("value", [1, 3, validation.MAX_ATTEMPTS_LIMIT])
def test_max_attempts_in_range_is_accepted(value: int) -> None:
    assert validation.check_max_attempts(value) == value


@pytest.mark.parametrize("value", [0, -1, validation.MAX_ATTEMPTS_LIMIT + 1, 2.0, "3", None, True])
def test_bad_max_attempts_is_refused(value: Any) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_max_attempts(value)
    assert_option_error(
        info.value, "max_attempts", f"1 to {validation.MAX_ATTEMPTS_LIMIT}", repr(value)
    )


@pytest.mark.parametrize("key", [None, "k", "order-42", "x" * validation.MAX_IDEMPOTENCY_KEY])
def test_good_idempotency_key_is_kept(key: str | None) -> None:
    assert validation.check_idempotency_key(key) == key


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("", "non-empty"),
        ("x" * (validation.MAX_IDEMPOTENCY_KEY + 1), "at most 255"),
        (42, "string"),
        (b"k", "string"),
    ],
)
def test_bad_idempotency_key_is_refused(key: Any, fragment: str) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_idempotency_key(key)
    assert_option_error(info.value, "idempotency_key", fragment)


def test_idempotency_key_with_nul_is_refused_naming_the_nul() -> None:
    """The key is short and non-empty; a message saying "must be a non-empty string of at most
    255 chars" would send the user looking for the wrong problem."""
    with pytest.raises(InvalidOption) as info:
        validation.check_idempotency_key("order\x0042")
    assert_option_error(info.value, "idempotency_key", "NUL")


@pytest.mark.parametrize("timeout", [0, -1, 3601, float("nan"), "10", True])
def test_bad_timeout_is_refused(timeout: Any) -> None:
    with pytest.raises(InvalidOption) as info:
        validation.check_timeout(timeout, maximum=3600)
    assert_option_error(info.value, "timeout", "(0, 3600]")


def test_good_timeout_is_seconds() -> None:
    assert validation.check_timeout(30, maximum=3600) == 30.0


# --- the handler-signature check: a fast path that must agree with inspect's bind ---------


def _h1(ctx, a, b=1): ...  # type: ignore[no-untyped-def]
def _h2(ctx, *, a, **kw): ...  # type: ignore[no-untyped-def]
def _h3(ctx, /, a, **kw): ...  # type: ignore[no-untyped-def]
def _h4(ctx, a, *args): ...  # type: ignore[no-untyped-def]
def _h5(*, a): ...  # type: ignore[no-untyped-def]
def _h6(ctx, **kw): ...  # type: ignore[no-untyped-def]
def _h7(): ...  # type: ignore[no-untyped-def]
def _h8(ctx, a, /, b): ...  # type: ignore[no-untyped-def]


@pytest.mark.parametrize("handler", [_h1, _h2, _h3, _h4, _h5, _h6, _h7, _h8])
def test_signature_check_agrees_with_inspect_bind(handler: Any) -> None:
    payloads: list[dict[str, Any]] = [
        {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"ctx": 1}, {"a": 1, "ctx": 2}, {"c": 3},
        {"a": 1, "c": 3}, {"a": 1, "b": 2, "c": 3},
    ]  # fmt: skip
    for payload in payloads:
        try:
            inspect.signature(handler).bind(None, **payload)
            fits = True
        except TypeError:
            fits = False
        if fits:
            check_signature(handler, payload)
        else:
            with pytest.raises(InvalidPayload, match="does not fit the handler's parameters"):
                check_signature(handler, payload)
