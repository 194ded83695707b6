"""API keys as values (:class:`KeyInfo`: never the secret, only its hint), the ways to name one
(:data:`KeyRef`), and the checks every argument passes before anything is stored."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import RowMapping

from harvest.coordination import keys
from harvest.coordination.key_pool import STATUSES, Status
from harvest.coordination.rate_limit import parse_rate
from harvest.errors import InvalidKey
from harvest.models import ApiKeyRow

KeyRef = int | tuple[str, str]
"""A key by id, or by ``(pool, name)``."""

MAX_CONCURRENCY = 10_000
MAX_TPM = 10**12
MAX_SECRET_CHARS = 16_384
_NAME_RULE = "use 1-200 characters from letters, digits and _.:/@=+-"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """An API key as anyone but a worker may see it: never the secret, only its hint."""

    id: int
    pool: str
    name: str
    hint: str
    max_concurrency: int
    rate_limit: str | None
    status: Status
    cooldown_until: datetime | None
    last_used_at: datetime | None
    tpm: int | None = None  # tokens per minute (None: no token budget)

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> KeyInfo:
        """From a row of ``_COLUMNS``."""
        return cls(
            id=int(row["id"]),
            pool=row["pool"],
            name=row["name"],
            hint=row["hint"],
            max_concurrency=int(row["max_concurrency"]),
            rate_limit=row["rate_limit"],
            status=key_status(row["status"]),
            cooldown_until=row["cooldown_until"],
            last_used_at=row["last_used_at"],
            tpm=None if row.get("tpm") is None else int(row["tpm"]),
        )

    @classmethod
    def from_model(cls, row: ApiKeyRow) -> KeyInfo:
        """From an ORM row (as get_or_create returns it)."""
        return cls(
            id=row.id,
            pool=row.pool,
            name=row.name,
            hint=row.secret_hint,
            max_concurrency=row.max_concurrency,
            rate_limit=row.rate_limit,
            status=key_status(row.status),
            cooldown_until=row.cooldown_until,
            last_used_at=row.last_used_at,
            tpm=row.tpm,
        )


def key_status(value: str) -> Status:
    if value not in STATUSES:
        raise ValueError(f"unexpected API key status in Postgres: {value!r}")
    return cast(Status, value)


def shown(value: object) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 60 else text_[:57] + "..."


def check_name(field: str, value: object) -> str:
    """A pool or key name, or :class:`InvalidKey` naming ``field``."""
    try:
        return keys.check_name(field, cast(str, value))
    except ValueError:
        raise InvalidKey(field, f"{shown(value)}: {_NAME_RULE}") from None


def check_max_concurrency(value: object) -> int:
    """An integer 1..10000, or :class:`InvalidKey`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise InvalidKey("max_concurrency", f"{shown(value)}: must be 1..{MAX_CONCURRENCY}")
    return value


def check_tpm(value: object) -> int | None:
    """Tokens per minute 1..10^12, None for no token budget, or :class:`InvalidKey`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TPM:
        raise InvalidKey("tpm", f"{shown(value)}: must be a whole number of tokens, 1..{MAX_TPM}")
    return value


def check_rate(value: object) -> str | None:
    """A rate such as ``"60/m"`` (stored without spaces), None for no limit, or InvalidKey."""
    if value is None:
        return None
    try:
        parse_rate(cast(str, value))
    except ValueError:
        raise InvalidKey(
            "rate_limit",
            f"{shown(value)} is not a rate such as '60/m', '5/s', '1000/h' or '10/2s'",
        ) from None
    return "".join(cast(str, value).split())


def check_secret(value: object) -> str:
    """A usable secret, or :class:`InvalidKey` (whose message never contains the secret)."""
    if not isinstance(value, str):
        raise InvalidKey("secret", f"must be a string, not {type(value).__name__}")
    if not value.strip():
        raise InvalidKey("secret", "is empty")
    if value != value.strip():
        raise InvalidKey("secret", "has leading or trailing whitespace")
    if len(value) > MAX_SECRET_CHARS:
        raise InvalidKey("secret", f"is longer than {MAX_SECRET_CHARS} characters")
    return value
