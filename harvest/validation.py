"""Checks at the door: everything enqueue refuses, with an error that names the problem."""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from harvest.errors import InvalidOption, InvalidPayload, PayloadTooLarge

MAX_DEPTH = 64
PRIORITY_RANGE = (-1000, 1000)
MAX_ATTEMPTS_LIMIT = 1000
MAX_IDEMPOTENCY_KEY = 255
MAX_DELAY = 10 * 365 * 86400.0  # ten years: further out is a mistake, not a schedule


def _check_values(value: Any, depth: int, path: str) -> None:
    if depth > MAX_DEPTH:
        raise InvalidPayload(f"nested deeper than {MAX_DEPTH} levels at {path}")
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidPayload(f"NUL character at {path} (Postgres jsonb cannot store it)")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidPayload(
                f"string at {path} is not valid Unicode (a lone surrogate)"
            ) from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidPayload(f"{value} at {path} is not valid JSON")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidPayload(f"key {key!r} at {path} is not a string")
            _check_values(key, depth + 1, path)
            _check_values(item, depth + 1, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_values(item, depth + 1, f"{path}[{i}]")
    elif value is not None and not isinstance(value, bool | int):
        raise InvalidPayload(f"{type(value).__name__} at {path} is not JSON")


def _as_dict(value: Any) -> dict[str, Any]:
    """json.dumps hook: any Mapping (checked above) encodes as an object."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


# One encoder for every payload (json.dumps with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=_as_dict)


def encode_payload(payload: Any, *, limit: int) -> str:
    """The payload as compact JSON text, or InvalidPayload / PayloadTooLarge."""
    if not isinstance(payload, Mapping):
        raise InvalidPayload(
            f"must be a JSON object (the handler's keyword arguments), got {type(payload).__name__}"
        )
    _check_values(payload, 0, "payload")
    encoded = _ENCODER.encode(payload)
    # Each character is 1 to 4 bytes of UTF-8: count the bytes only when that matters.
    if len(encoded) * 4 > limit and (size := len(encoded.encode())) > limit:
        raise PayloadTooLarge(size, limit)
    return encoded


@dataclass(frozen=True, slots=True)
class _Params:
    """What keyword arguments a handler ``handler(ctx, **payload)`` accepts."""

    signature: inspect.Signature
    names: frozenset[str]  # every keyword it accepts by name
    required: frozenset[str]  # those without a default
    any_keyword: bool  # it takes **kwargs
    ctx_name: str | None  # the ctx parameter's name, when a keyword could collide with it
    simple: bool  # the set check above is the whole story (else: inspect's bind decides)


@functools.lru_cache(maxsize=4096)
def _params_of(func: Callable[..., Any]) -> _Params:
    """A handler's parameters, worked out once (bulk enqueue checks every payload)."""
    signature = inspect.signature(func)
    P = inspect.Parameter
    every = list(signature.parameters.values())
    first, params = (every[0], every[1:]) if every else (None, [])
    kinds = {p.kind for p in params}
    keyword = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    simple = (
        first is not None
        and first.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
        and kinds <= {*keyword, P.VAR_KEYWORD}
    )
    return _Params(
        signature,
        frozenset(p.name for p in params if p.kind in keyword),
        frozenset(p.name for p in params if p.kind in keyword and p.default is p.empty),
        P.VAR_KEYWORD in kinds,
        first.name if first is not None and first.kind is P.POSITIONAL_OR_KEYWORD else None,
        simple,
    )


def check_signature(func: Callable[..., Any], payload: Mapping[str, Any]) -> None:
    """The payload must bind to ``handler(ctx, **payload)``."""
    params = _params_of(func)
    if params.simple:
        keys = payload.keys()
        if (
            params.required <= keys
            and (params.any_keyword or keys <= params.names)
            and params.ctx_name not in keys
        ):
            return
    try:  # the slow path, for its message (and for unusual signatures)
        params.signature.bind(None, **payload)
    except TypeError as exc:
        raise InvalidPayload(f"does not fit the handler's parameters: {exc}") from None


def check_priority(priority: Any) -> int:
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise InvalidOption(
            "priority", f"must be an integer from {low} to {high}, got {priority!r}"
        )
    return priority


def check_max_attempts(value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_ATTEMPTS_LIMIT
    ):
        raise InvalidOption(
            "max_attempts", f"must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}, got {value!r}"
        )
    return value


def check_delay(delay: Any) -> float | None:
    if delay is None:
        return None
    if isinstance(delay, timedelta):
        delay = delay.total_seconds()
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay):
        raise InvalidOption("delay", f"must be seconds or a timedelta, got {delay!r}")
    if delay < 0:
        raise InvalidOption("delay", f"must not be negative, got {delay!r}")
    if delay > MAX_DELAY:
        raise InvalidOption("delay", f"must be at most {MAX_DELAY:.0f} seconds (ten years)")
    return float(delay)


def check_run_at(run_at: Any) -> datetime | None:
    if run_at is None:
        return None
    if not isinstance(run_at, datetime):
        raise InvalidOption("run_at", f"must be a datetime, got {type(run_at).__name__}")
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise InvalidOption("run_at", "must be timezone-aware (e.g. datetime.now(UTC))")
    return run_at


def check_idempotency_key(key: Any) -> str | None:
    if key is None:
        return None
    if isinstance(key, str) and "\x00" in key:
        raise InvalidOption("idempotency_key", "must not contain a NUL character")
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY:
        raise InvalidOption(
            "idempotency_key", f"must be a non-empty string of at most {MAX_IDEMPOTENCY_KEY} chars"
        )
    return key


def check_timeout(timeout: Any, *, maximum: float) -> float:
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= maximum
    ):
        raise InvalidOption("timeout", f"must be seconds in (0, {maximum:g}], got {timeout!r}")
    return float(timeout)
