"""Checks at the door: everything enqueue refuses, with an error that names the problem."""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from harvest.errors import InvalidOption, InvalidPayload, PayloadTooLarge

MAX_DEPTH = 64
PRIORITY_RANGE = (-1000, 1000)
MAX_ATTEMPTS_LIMIT = 1000
MAX_IDEMPOTENCY_KEY = 255
MAX_DELAY = 10 * 365 * 86400.0  # ten years: further out is a mistake, not a schedule
# The instants every side can hold: Python's datetime (years 1 to 9999 in the zone it is read
# in) and Postgres' timestamptz. A day's margin at each end keeps a time readable whatever
# the session's time zone (offsets are under a day), so a stored job can always be read back.
RUN_AT_MIN = datetime(1, 1, 2, tzinfo=UTC)
RUN_AT_MAX = datetime(9999, 12, 30, tzinfo=UTC)
# A float this large is written by Python in exponent form (1e+16) and read back from jsonb as
# an integer (Postgres prints numerics in full): such floats are encoded as "digits.0".
_FLOAT_EXPONENT_FORM = 1e16


def _max_int_digits() -> int:
    """Python's own limit on int <-> str conversion (0: none): a longer integer cannot be
    written as JSON nor read back from it."""
    limit = sys.get_int_max_str_digits()
    return limit if limit > 0 else 1 << 62


def _int_fits(value: int) -> bool:
    limit = _max_int_digits()
    # bit_length * log10(2) digits, within one: the cheap test settles all but the border
    if value.bit_length() * 0.30103 < limit - 1:
        return True
    return bool(abs(value) < 10**limit)


def shown(value: Any, width: int = 80) -> str:
    """``repr(value)`` for an error message: at most ``width`` characters, and never raising
    (an integer beyond Python's 4300-digit limit cannot be written out; a __repr__ may fail)."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"an integer of {value.bit_length()} bits"
        return f"a {type(value).__name__}"
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) <= width else text[: width - 1] + "…"


def unicode_problem(value: str) -> str | None:
    """Why Postgres cannot store ``value`` as text (None: it can)."""
    if "\x00" in value:
        return "a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (not valid Unicode)"
    return None


def _shown(key: str) -> str:
    """A payload key for a message: printable, short, and encodable whatever it holds."""
    return repr(key[:40]) if unicode_problem(key) else key[:80]


class _Unsure(Exception):
    """The quick check's "ask the exact one": a value it does not judge, or a refusal."""


_QUICK_INT = 1 << 63  # an integer below this in size has far fewer digits than any limit


def _quick_item(value: Any, depth: int) -> bool:
    """:func:`_check_values`'s verdict on the common payload (dicts, lists and the JSON scalars,
    nothing refused), without a path made for every key: True when a float needs the slow
    encoder. Raises :class:`_Unsure` for anything else, which the exact check then judges
    (and names, when refused)."""
    kind = type(value)
    if kind is str:
        if not (value.isascii() and "\x00" not in value) and unicode_problem(value) is not None:
            raise _Unsure
        return False
    if kind is int:
        if not -_QUICK_INT < value < _QUICK_INT:
            raise _Unsure
        return False
    if kind is bool or value is None:
        return False
    if kind is float:
        if not math.isfinite(value):
            raise _Unsure
        big: bool = abs(value) >= _FLOAT_EXPONENT_FORM
        return big
    if depth >= MAX_DEPTH:
        raise _Unsure
    slow = False
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or (
                not (key.isascii() and "\x00" not in key) and unicode_problem(key) is not None
            ):
                raise _Unsure
            slow = _quick_item(item, depth + 1) or slow
    elif kind is list:
        for item in value:
            slow = _quick_item(item, depth + 1) or slow
    else:
        raise _Unsure
    return slow


def check_values(payload: Any) -> bool:
    """Raise InvalidPayload, naming where, at the first value of ``payload`` that cannot
    round-trip through JSON, jsonb and back; True when a float needs the slow encoder."""
    try:
        return _quick_item(payload, 0)
    except _Unsure:
        return _check_values(payload, 0, "payload")


def _check_values(value: Any, depth: int, path: str) -> bool:
    """Raise InvalidPayload at the first value that cannot round-trip through JSON, jsonb and
    back; True when a float needs the slow encoder (see :data:`_FLOAT_EXPONENT_FORM`)."""
    if depth > MAX_DEPTH:
        raise InvalidPayload(f"nested deeper than {MAX_DEPTH} levels at {path}")
    if isinstance(value, str):
        problem = unicode_problem(value)
        if problem is not None:
            raise InvalidPayload(f"string at {path} holds {problem}; Postgres cannot store it")
        return False
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int):
        if not _int_fits(value):
            raise InvalidPayload(
                f"integer at {path} has more than {_max_int_digits()} digits "
                "(JSON readers, Python's among them, cannot read it back)"
            )
        return False
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidPayload(f"{value} at {path} is not valid JSON")
        return abs(value) >= _FLOAT_EXPONENT_FORM
    slow = False
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidPayload(f"key {shown(key)} at {path} is not a string")
            problem = unicode_problem(key)
            if problem is not None:
                raise InvalidPayload(f"a key at {path} ({_shown(key)}) holds {problem}")
            slow = _check_values(item, depth + 1, f"{path}.{_shown(key)}") or slow
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            slow = _check_values(item, depth + 1, f"{path}[{i}]") or slow
    else:
        raise InvalidPayload(f"{type(value).__name__} at {path} is not JSON")
    return slow


def _as_dict(value: Any) -> dict[str, Any]:
    """json.dumps hook: any Mapping (checked above) encodes as an object."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


# One encoder for every payload (json.dumps with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=_as_dict)

# And its C core, made once: ``JSONEncoder.encode`` makes one per call (with a dict to catch
# cycles and a closure for floats), as much again as encoding a small payload. Without the
# cycle check: it serves only values already checked, whose depth is bounded (a cycle is
# "nested deeper than MAX_DEPTH").
_MAKE_C_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)  # None without _json
_C_ENCODE = (
    _MAKE_C_ENCODER(
        None, _as_dict, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False
    )
    if _MAKE_C_ENCODER is not None
    else None
)


def _encode_checked(value: Any) -> str:
    """Compact JSON text of a value :func:`_check_values` accepted."""
    if _C_ENCODE is None:
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))


def payload_from_json(text: str, *, option: str = "--payload") -> dict[str, Any]:
    """A payload given as JSON text (a command-line option): a JSON object, or InvalidPayload
    naming ``option`` (never a traceback: bad syntax, nesting, a number too long to read)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidPayload(
            f"{option} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise InvalidPayload(f"{option} is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # an integer longer than Python reads (sys.get_int_max_str_digits)
        raise InvalidPayload(f"{option} cannot be read: {str(exc).split(';')[0]}") from None
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise InvalidPayload(
            f"{option} must be a JSON object (the handler's keyword arguments), got {kind}"
        )
    return data


def _encode_slow(value: Any) -> str:
    """JSON text of a checked value whose large floats are written in full ("1e+23" becomes
    "100000000000000000000000.0"), so that jsonb keeps them floats and Python reads back the
    same float."""
    if isinstance(value, float) and abs(value) >= _FLOAT_EXPONENT_FORM:
        return f"{Decimal(repr(value)):f}.0"
    if isinstance(value, Mapping):
        items = (f"{_ENCODER.encode(k)}:{_encode_slow(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_encode_slow(v) for v in value) + "]"
    return _ENCODER.encode(value)


def encode_payload(payload: Any, *, limit: int) -> str:
    """The payload as compact JSON text, or InvalidPayload / PayloadTooLarge."""
    if not isinstance(payload, Mapping):
        raise InvalidPayload(
            f"must be a JSON object (the handler's keyword arguments), got {type(payload).__name__}"
        )
    encoded = _encode_slow(payload) if check_values(payload) else _encode_checked(payload)
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
            "priority", f"must be an integer from {low} to {high}, got {shown(priority)}"
        )
    return priority


def check_max_attempts(value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_ATTEMPTS_LIMIT
    ):
        raise InvalidOption(
            "max_attempts", f"must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}, got {shown(value)}"
        )
    return value


def check_delay(delay: Any) -> float | None:
    if delay is None:
        return None
    if isinstance(delay, timedelta):
        delay = delay.total_seconds()
    if (
        isinstance(delay, bool)
        or not isinstance(delay, int | float)
        or (isinstance(delay, float) and not math.isfinite(delay))
    ):
        raise InvalidOption("delay", f"must be seconds or a timedelta, got {shown(delay)}")
    if delay < 0:
        raise InvalidOption("delay", f"must not be negative, got {shown(delay)}")
    if delay > MAX_DELAY:
        raise InvalidOption("delay", f"must be at most {MAX_DELAY:.0f} seconds (ten years)")
    if 0 < delay < 1e-6:
        return 0.0  # below Postgres' microsecond: due now
    return float(delay)


def check_run_at(run_at: Any) -> datetime | None:
    if run_at is None:
        return None
    if not isinstance(run_at, datetime):
        raise InvalidOption("run_at", f"must be a datetime, got {type(run_at).__name__}")
    try:
        offset = run_at.utcoffset()
    except Exception as exc:  # a tzinfo of the caller's that cannot say
        raise InvalidOption("run_at", f"its time zone failed to give an offset: {exc}") from None
    if offset is None:
        raise InvalidOption("run_at", "must be timezone-aware (e.g. datetime.now(UTC))")
    # Compared before converting: converting an instant outside Python's range overflows.
    if not RUN_AT_MIN <= run_at <= RUN_AT_MAX:
        raise InvalidOption(
            "run_at",
            f"must be between {RUN_AT_MIN.date()} and {RUN_AT_MAX.date()} (UTC), "
            f"got {run_at.isoformat()}",
        )
    return run_at.astimezone(UTC)


def check_idempotency_key(key: Any) -> str | None:
    if key is None:
        return None
    if isinstance(key, str) and (problem := unicode_problem(key)) is not None:
        raise InvalidOption("idempotency_key", f"must not contain {problem}")
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
        raise InvalidOption("timeout", f"must be seconds in (0, {maximum:g}], got {shown(timeout)}")
    return float(timeout)


MAX_QUEUE = 200  # characters of a queue name
MAX_TENANT = MAX_QUEUE  # characters of a tenant (fairness key)


# What check_name allows, as a JSON-schema pattern (for the API's documents): no control
# character (Unicode category Cc), at least one character that is not whitespace.
NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"


def check_queue(queue: Any) -> str:
    """A queue name (``queue=`` of a job, and what pause and resume take): text of 1 to
    :data:`MAX_QUEUE` characters, not only whitespace, no control character, storable."""
    return check_name(queue, "queue", MAX_QUEUE)


def check_tenant(tenant: Any) -> str | None:
    """A job's fairness key (``tenant=`` of enqueue): None (no tenant), or a name under the
    rules of a queue name (1 to :data:`MAX_TENANT` characters, not only whitespace, no control
    character, storable)."""
    return None if tenant is None else check_name(tenant, "tenant", MAX_TENANT)


def check_name(value: Any, option: str, most: int) -> str:
    """A name given as ``option``: text of 1 to ``most`` characters, not only whitespace, no
    control character, storable; raises InvalidOption naming ``option``."""
    if not isinstance(value, str):
        raise InvalidOption(option, f"must be text, got {shown(value)}")
    if not value.strip():
        raise InvalidOption(option, "must not be empty or only whitespace")
    if len(value) > most:
        raise InvalidOption(option, f"must be at most {most} characters, got {len(value)}")
    problem = unicode_problem(value)
    if problem is not None:
        raise InvalidOption(option, f"must not contain {problem}")
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise InvalidOption(option, f"must not contain control characters, got {shown(value)}")
    return value
