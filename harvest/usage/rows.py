"""Every statement on the usage tables (``harvest_key_usage``, ``harvest_key_usage_totals``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text

from harvest.usage.tally import Bucket, Counts

_UNNEST = """
    SELECT * FROM unnest(
        CAST(:pools AS text[]), CAST(:keys AS bigint[]), CAST(:tenants AS text[]),
        CAST(:requests AS bigint[]), CAST(:tokens AS bigint[]), CAST(:limited AS bigint[]),
        CAST(:errors AS bigint[]))
"""
_ADD = """
    ON CONFLICT ({target}) DO UPDATE SET
        requests = u.requests + excluded.requests,
        tokens = u.tokens + excluded.tokens,
        rate_limited = u.rate_limited + excluded.rate_limited,
        errors = u.errors + excluded.errors
"""
_ADD_MINUTES = text(
    """
    INSERT INTO harvest_key_usage AS u
        (minute, pool, key_id, tenant, requests, tokens, rate_limited, errors)
    SELECT to_timestamp(m), p, k, t, r, tk, l, e FROM unnest(
        CAST(:minutes AS double precision[]), CAST(:pools AS text[]), CAST(:keys AS bigint[]),
        CAST(:tenants AS text[]), CAST(:requests AS bigint[]), CAST(:tokens AS bigint[]),
        CAST(:limited AS bigint[]), CAST(:errors AS bigint[])) AS x(m, p, k, t, r, tk, l, e)
    """
    + _ADD.format(target="minute, pool, key_id, tenant")
)
_ADD_TOTALS = text(
    "INSERT INTO harvest_key_usage_totals AS u "
    "(pool, key_id, tenant, requests, tokens, rate_limited, errors)"
    + _UNNEST
    + _ADD.format(target="pool, key_id, tenant")
)


def add(conn: Connection, rows: Sequence[tuple[Bucket, Counts]]) -> None:
    """Add a tally's rows to their minutes and to the running totals (two statements, whatever
    the number of rows). ``rows`` sorted by bucket, one per bucket."""
    if not rows:
        return
    conn.execute(_ADD_MINUTES, {"minutes": [b[0] for b, _ in rows], **_columns(rows)})
    totals: dict[tuple[str, int, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (_, pool, key_id, tenant), counts in rows:
        have = totals[(pool, key_id, tenant)]
        for i, n in enumerate(counts):
            have[i] += n
    summed = sorted(((0.0, *k), (v[0], v[1], v[2], v[3])) for k, v in totals.items())
    conn.execute(_ADD_TOTALS, _columns(summed))


def _columns(rows: Sequence[tuple[Bucket, Counts]]) -> dict[str, list[object]]:
    return {
        "pools": [b[1] for b, _ in rows],
        "keys": [b[2] for b, _ in rows],
        "tenants": [b[3] for b, _ in rows],
        "requests": [c[0] for _, c in rows],
        "tokens": [c[1] for _, c in rows],
        "limited": [c[2] for _, c in rows],
        "errors": [c[3] for _, c in rows],
    }


@dataclass(frozen=True, slots=True)
class Figures:
    """Usage summed over a pool's keys (``key_id`` None) or of one key, in a minute or over
    all time. ``key`` is the key's name (``#id`` for a key since deleted)."""

    pool: str
    key_id: int | None
    key: str | None
    minute: datetime | None
    requests: int
    tokens: int
    rate_limited: int
    errors: int
    tenant: str | None = None  # per_tenant's: the jobs' tenant (None: jobs without one)


_PER_MINUTE = text(
    """
    SELECT pool, minute, sum(requests), sum(tokens), sum(rate_limited), sum(errors)
    FROM harvest_key_usage WHERE minute >= now() - make_interval(mins => :minutes)
    GROUP BY pool, minute ORDER BY pool, minute
    """
)
_PER_KEY = text(
    """
    SELECT u.pool, u.key_id, coalesce(k.name, '#' || u.key_id), sum(u.requests),
           sum(u.tokens), sum(u.rate_limited), sum(u.errors)
    FROM {table} u LEFT JOIN harvest_api_keys k ON k.id = u.key_id
    {where}
    GROUP BY u.pool, u.key_id, k.name ORDER BY u.pool, k.name, u.key_id
    """
)
_PER_KEY_RECENT = text(
    _PER_KEY.text.format(
        table="harvest_key_usage",
        where="WHERE u.minute >= now() - make_interval(mins => :minutes)",
    )
)
_PER_KEY_TOTAL = text(_PER_KEY.text.format(table="harvest_key_usage_totals", where=""))


def per_minute(conn: Connection, *, minutes: int) -> list[Figures]:
    """Each pool's usage per minute over the last ``minutes`` (minutes without calls absent)."""
    return [
        Figures(r[0], None, None, r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5]))
        for r in conn.execute(_PER_MINUTE, {"minutes": minutes})
    ]


def per_key(conn: Connection, *, minutes: int | None) -> list[Figures]:
    """Each key's usage over the last ``minutes`` (None: since it was first used)."""
    query = _PER_KEY_TOTAL if minutes is None else _PER_KEY_RECENT
    return [
        Figures(r[0], r[1], r[2], None, int(r[3]), int(r[4]), int(r[5]), int(r[6]))
        for r in conn.execute(query, {"minutes": minutes})
    ]


_PER_TENANT = """
    SELECT pool, tenant, sum(requests), sum(tokens), sum(rate_limited), sum(errors)
    FROM {table} {where} GROUP BY pool, tenant ORDER BY pool, tenant
"""
_PER_TENANT_RECENT = text(
    _PER_TENANT.format(
        table="harvest_key_usage", where="WHERE minute >= now() - make_interval(mins => :minutes)"
    )
)
_PER_TENANT_TOTAL = text(_PER_TENANT.format(table="harvest_key_usage_totals", where=""))


def per_tenant(conn: Connection, *, minutes: int | None) -> list[Figures]:
    """Each pool's usage by the jobs' tenant over the last ``minutes`` (None: all time)."""
    query = _PER_TENANT_TOTAL if minutes is None else _PER_TENANT_RECENT
    return [
        Figures(r[0], None, None, None, int(r[2]), int(r[3]), int(r[4]), int(r[5]), r[1] or None)
        for r in conn.execute(query, {"minutes": minutes})
    ]


_PRUNE = text(
    """
    DELETE FROM harvest_key_usage WHERE (minute, pool, key_id, tenant) IN (
        SELECT minute, pool, key_id, tenant FROM harvest_key_usage
        WHERE minute < now() - make_interval(secs => :age)
        ORDER BY minute
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    """
)


def prune(conn: Connection, *, older_than: float, limit: int) -> int:
    """Delete up to ``limit`` minute rows older than ``older_than`` seconds (the totals stay)."""
    return int(conn.execute(_PRUNE, {"age": older_than, "limit": limit}).rowcount)
