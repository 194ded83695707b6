"""The Usage page and its API: each pool's requests, 429s, errors and tokens per minute, and
each key's over the same window, as the workers wrote them (:mod:`harvest.usage`; the last
``HARVEST_USAGE_FLUSH_INTERVAL`` seconds are not in yet). A chart per pool, drawn on the server."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from markupsafe import Markup
from pydantic import Field
from sqlalchemy.exc import InterfaceError, OperationalError

from harvest.app import Harvest
from harvest.db import unavailable
from harvest.usage import rows
from harvest.web import charts, pages
from harvest.web.api import ERRORS
from harvest.web.models import Out

router = APIRouter(include_in_schema=False)
api_router = APIRouter(prefix="/api", responses={401: ERRORS[401], 503: ERRORS[503]})

Minutes = Annotated[int, Query(ge=5, le=1440, description="The window: the last N minutes.")]


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """One pool over the window: a row per minute (minutes without calls as zeros), and the
    window's sums per key and per tenant of the jobs."""

    pool: str
    minutes: list[rows.Figures]
    keys: list[rows.Figures]
    tenants: list[rows.Figures]


def window(app: Harvest, *, minutes: int) -> list[PoolUsage]:
    """Every pool that made calls in the last ``minutes``."""
    try:
        with app.engine.connect() as conn:
            per_minute = rows.per_minute(conn, minutes=minutes)
            per_key = rows.per_key(conn, minutes=minutes)
            per_tenant = rows.per_tenant(conn, minutes=minutes)
    except (OperationalError, InterfaceError) as exc:
        raise unavailable(exc) from None
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    starts = [now - timedelta(minutes=i) for i in range(minutes - 1, -1, -1)]
    pools = sorted({f.pool for f in per_minute} | {f.pool for f in per_key})
    out = []
    for pool in pools:
        seen = {f.minute: f for f in per_minute if f.pool == pool}
        filled = [seen.get(at) or rows.Figures(pool, None, None, at, 0, 0, 0, 0) for at in starts]
        out.append(
            PoolUsage(
                pool,
                filled,
                [f for f in per_key if f.pool == pool],
                [f for f in per_tenant if f.pool == pool],
            )
        )
    return out


def pool_charts(one: PoolUsage) -> dict[str, Markup]:
    labels = [f.minute.astimezone(UTC).strftime("%H:%M") for f in one.minutes if f.minute]
    calls = charts.bars(
        f"Requests per minute, pool {one.pool}",
        labels,
        [
            charts.Series(
                "answered", [f.requests - f.rate_limited - f.errors for f in one.minutes]
            ),
            charts.Series("429", [f.rate_limited for f in one.minutes]),
            charts.Series("errors", [f.errors for f in one.minutes]),
        ],
    )
    tokens = charts.bars(
        f"Tokens per minute, pool {one.pool}",
        labels,
        [charts.Series("tokens", [f.tokens for f in one.minutes])],
    )
    return {"calls": calls, "tokens": tokens}


# --- page -----------------------------------------------------------------------------------


@router.get("/usage", response_class=HTMLResponse)
def usage_page(request: Request, minutes: Minutes = 60) -> HTMLResponse:
    pools = window(request.app.state.harvest, minutes=minutes)
    drawn = [(p, pool_charts(p)) for p in pools]
    return pages.render(request, "usage.html", pools=drawn, minutes=minutes)


# --- API ------------------------------------------------------------------------------------


class UsageFiguresOut(Out):
    requests: int = Field(description="Calls made with the key(s).")
    tokens: int = Field(description="Tokens reported (ctx.used), else reserved.")
    rate_limited: int = Field(description="Calls answered 429.")
    errors: int = Field(description="Calls whose attempt ended in another error.")


class UsageMinuteOut(UsageFiguresOut):
    minute: datetime


class UsageKeyOut(UsageFiguresOut):
    key_id: int
    key: str = Field(description="The key's name ('#id' for a key since deleted).")


class UsageTenantOut(UsageFiguresOut):
    tenant: str | None = Field(description="The jobs' tenant (null: jobs enqueued without one).")


class PoolUsageOut(Out):
    pool: str
    minutes: list[UsageMinuteOut]
    keys: list[UsageKeyOut]
    tenants: list[UsageTenantOut]


def _figures(f: rows.Figures) -> dict[str, int]:
    return {"requests": f.requests, "tokens": f.tokens, "rate_limited": f.rate_limited,
            "errors": f.errors}  # fmt: skip


@api_router.get("/usage", summary="Requests, tokens, 429s and errors per pool per minute, and "
                "per key and per tenant over the window")  # fmt: skip
def usage(request: Request, minutes: Minutes = 60) -> list[PoolUsageOut]:
    return [
        PoolUsageOut(
            pool=p.pool,
            minutes=[UsageMinuteOut(minute=f.minute, **_figures(f)) for f in p.minutes if f.minute],
            keys=[
                UsageKeyOut(key_id=f.key_id or 0, key=f.key or "", **_figures(f)) for f in p.keys
            ],
            tenants=[UsageTenantOut(tenant=f.tenant, **_figures(f)) for f in p.tenants],
        )
        for p in window(request.app.state.harvest, minutes=minutes)
    ]
