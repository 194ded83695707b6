"""The ASGI app of ``harvest web``: pages, the JSON API, static files, all behind the Guard
(authentication, CSRF, security headers).

It reads and acts only through the library (:mod:`harvest.web.data`), with one engine and one
Redis client of its own, made at startup and closed at shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from harvest.app import Harvest
from harvest.db import make_engine
from harvest.errors import HarvestError, InvalidFilter, LockNotAcquired, ServiceUnavailable
from harvest.redact import redact_text
from harvest.settings import Settings
from harvest.web import api, auth, data, pages, queues, usage
from harvest.web.throttle import LoginThrottle, ThrottlePolicy

DB_POOL_SIZE = 4
DESCRIPTION = """The data and actions of the harvest dashboard.

Every call needs HTTP Basic auth (`HARVEST_WEB_USER` / `HARVEST_WEB_PASSWORD`). Every POST also
needs the CSRF token: `GET /api/csrf` returns it and sets the `harvest_csrf` cookie; send the
token as the `X-CSRF-Token` header together with that cookie. API key secrets are never
returned: keys show as their masked hint (`sk-…abcd`)."""


def create_app(
    settings: Settings,
    *,
    credentials: auth.Credentials | None,
    harvest: Harvest | None = None,
    login_policy: ThrottlePolicy | None = None,
) -> FastAPI:
    """The dashboard for ``settings``' database and Redis.

    :param credentials: the one user allowed in; None serves without authentication (the
        caller has checked that it binds to loopback: :func:`harvest.web.auth.check_bind`).
    :param harvest: the library object to read through (default: one made here, with its
        own engine and Redis client, closed at shutdown).
    :param login_policy: how failed logins are throttled (default :class:`ThrottlePolicy`;
        the state is in ``settings``' Redis, see :mod:`harvest.web.throttle`).
    """

    throttle = LoginThrottle(settings.redis_url, login_policy) if credentials else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = harvest is None
        app.state.harvest = harvest or _harvest(settings)
        try:
            yield
        finally:
            if throttle is not None:
                await throttle.aclose()
            if owned:
                app.state.harvest.close()

    app = FastAPI(
        title="harvest web",
        version="1",
        description=DESCRIPTION,
        openapi_url="/api/openapi.json",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.include_router(api.router)
    app.include_router(queues.api_router)
    app.include_router(queues.router)
    app.include_router(usage.api_router)
    app.include_router(usage.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=pages.HERE / "static"), name="static")
    _errors(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(HeadAsGet)
    app.add_middleware(
        auth.Guard,
        credentials=credentials,
        signer=auth.CsrfSigner.for_credentials(credentials),
        throttle=throttle,
    )
    return app


def _harvest(settings: Settings) -> Harvest:
    engine = make_engine(settings, pool_size=DB_POOL_SIZE)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    return Harvest(settings, engine=engine, redis_client=client)


class HeadAsGet:
    """HEAD answered like GET without the body (the same status and headers, Content-Length
    included), on every page and API route that answers GET."""

    def __init__(self, app: auth.ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: auth.Scope, receive: auth.Receive, send: auth.Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headless(message: auth.Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headless)


# --- errors ---------------------------------------------------------------------------------


def _status_of(exc: Exception) -> int:
    if isinstance(exc, ServiceUnavailable | LockNotAcquired):
        return 503
    if isinstance(exc, LookupError):
        return 404
    if isinstance(exc, data.Conflict):
        return 409
    if isinstance(exc, InvalidFilter):
        return 422
    return 400


def _error(request: Request, status: int, detail: str) -> Response:
    if request.url.path.startswith("/api"):
        return JSONResponse({"detail": detail}, status_code=status)
    return pages.render(request, "error.html", status_code=status, status=status, detail=detail)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(HarvestError)
    async def harvest_error(request: Request, exc: HarvestError) -> Response:
        return _error(request, _status_of(exc), redact_text(str(exc)))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        if request.url.path.startswith("/api"):
            errors = [
                {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
                for e in exc.errors()
            ]
            return JSONResponse({"detail": errors}, status_code=422)
        fields = ", ".join(str(e.get("loc", ["?"])[-1]) for e in exc.errors())
        return _error(request, 422, f"invalid value for: {fields}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        response = _error(request, exc.status_code, detail)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response


# --- the OpenAPI document -------------------------------------------------------------------


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        components = schema.setdefault("components", {})
        components["securitySchemes"] = {
            "basic": {"type": "http", "scheme": "basic"},
            "csrf": {"type": "apiKey", "in": "header", "name": "X-CSRF-Token"},
        }
        schema["security"] = [{"basic": []}]
        for operations in schema.get("paths", {}).values():
            if "post" in operations:
                operations["post"]["security"] = [{"basic": [], "csrf": []}]
        app.openapi_schema = schema
    return app.openapi_schema
