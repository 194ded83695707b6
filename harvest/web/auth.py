"""Who may use the dashboard, and proof that a POST came from its own pages.

* Basic auth on every request (pages, API, static files, the OpenAPI document), against
  ``HARVEST_WEB_USER`` / ``HARVEST_WEB_PASSWORD``, compared in constant time. There is no
  default password: without credentials the server refuses to start, unless it is bound to
  loopback and told ``--insecure-no-auth`` (then only loopback ``Host`` names are answered, so a
  web page cannot reach it by DNS rebinding).
* CSRF: a signed double-submit cookie. Every response carries a token ``nonce.signature``
  (HMAC of the user and the nonce) in the ``harvest_csrf`` cookie (HttpOnly, SameSite=Strict);
  every POST must send the same token back, as the form field ``csrf_token`` or the header
  ``X-CSRF-Token``. Another site can make a browser send the cookie, but cannot read the token
  to send it back, and cannot make a token that verifies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from harvest.errors import ConfigurationError
from harvest.web.throttle import LoginThrottle

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CSRF_COOKIE = "harvest_csrf"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
MIN_PASSWORD = 8
MAX_FORM_BYTES = 64 * 1024
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)


class WebSettings(BaseSettings):
    """The dashboard's credentials: ``HARVEST_WEB_USER`` and ``HARVEST_WEB_PASSWORD``."""

    model_config = SettingsConfigDict(env_prefix="HARVEST_WEB_", extra="ignore", frozen=True)

    user: str | None = None
    password: SecretStr | None = None


@dataclass(frozen=True, slots=True)
class Credentials:
    """The one user and password the dashboard accepts. Never printed (``repr`` hides it)."""

    user: str
    password: SecretStr = field(repr=False)

    def check(self, user: str, password: str) -> bool:
        """True when both match; constant time in their contents (both are always compared)."""
        user_ok = hmac.compare_digest(user.encode(), self.user.encode())
        password_ok = hmac.compare_digest(
            password.encode(), self.password.get_secret_value().encode()
        )
        return user_ok & password_ok


def credentials_from(web: WebSettings) -> Credentials | None:
    """The credentials configured, None when neither variable is set.

    :raises ConfigurationError: only one is set, the user is blank or has a colon, or the
        password is shorter than 8 characters or only whitespace (the message never contains
        the password).
    """
    password = web.password.get_secret_value() if web.password is not None else ""
    user = (web.user or "").strip()
    if not user and not password:
        return None
    if not user or not password:
        missing = "HARVEST_WEB_USER" if not user else "HARVEST_WEB_PASSWORD"
        raise ConfigurationError(
            f"{missing} is not set: set both HARVEST_WEB_USER and the password"
        )
    if ":" in user:
        raise ConfigurationError("HARVEST_WEB_USER must not contain ':' (Basic auth separator)")
    if len(password) < MIN_PASSWORD:
        raise ConfigurationError(
            f"HARVEST_WEB_PASSWORD is too short: use at least {MIN_PASSWORD} characters"
        )
    if not password.strip():
        raise ConfigurationError(
            "HARVEST_WEB_PASSWORD is only whitespace: use at least "
            f"{MIN_PASSWORD} characters that are not all spaces"
        )
    return Credentials(user, SecretStr(password))


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_bind(host: str, credentials: Credentials | None, *, insecure_no_auth: bool) -> None:
    """Refuse to serve without authentication, except on loopback when asked explicitly.

    :raises ConfigurationError: no credentials (and not loopback + ``insecure_no_auth``), or
        ``insecure_no_auth`` on an address other than loopback.
    """
    if insecure_no_auth and not is_loopback(host):
        raise ConfigurationError(
            f"--insecure-no-auth is only allowed on loopback (127.0.0.1, ::1), not on {host!r}"
        )
    if credentials is None and not insecure_no_auth:
        raise ConfigurationError(
            "no credentials: set HARVEST_WEB_USER and HARVEST_WEB_PASSWORD (there is no default "
            "password); on loopback only, --insecure-no-auth serves without them"
        )


# --- CSRF tokens ----------------------------------------------------------------------------


class CsrfSigner:
    """Makes and checks tokens ``nonce.signature``, bound to a user."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @classmethod
    def for_credentials(cls, credentials: Credentials | None) -> CsrfSigner:
        """Keyed by the password when there is one (tokens then survive restarts and agree
        across replicas; whoever knows the password has no need to forge a token), else by
        a random key for this process."""
        if credentials is None:
            return cls(secrets.token_bytes(32))
        material = credentials.password.get_secret_value().encode()
        return cls(hmac.new(material, b"harvest-web-csrf-v1", hashlib.sha256).digest())

    def _sign(self, user: str, nonce: str) -> str:
        mac = hmac.new(self._secret, f"{user}\x00{nonce}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def new_token(self, user: str) -> str:
        nonce = secrets.token_urlsafe(18)
        return f"{nonce}.{self._sign(user, nonce)}"

    def valid(self, token: str | None, user: str) -> bool:
        if not token or token.count(".") != 1 or len(token) > 200:
            return False
        nonce, signature = token.split(".")
        return hmac.compare_digest(signature.encode(), self._sign(user, nonce).encode())


# --- the middleware -------------------------------------------------------------------------


def _headers(scope: Scope) -> dict[str, str]:
    """Request headers, lower-cased names (the first of repeated ones)."""
    found: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return found


def _cookie(header: str | None, name: str) -> str | None:
    for part in (header or "").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None


def _basic_auth(header: str | None) -> tuple[str, str] | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def _host_name(host_header: str | None) -> str:
    host = (host_header or "").strip()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _plain(send: Send, status: int, body: str, extra: list[tuple[bytes, bytes]]) -> None:
    payload = body.encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(payload)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _json(send: Send, status: int, detail: str, extra: list[tuple[bytes, bytes]]) -> None:
    import json

    payload = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class Guard:
    """ASGI middleware in front of everything: security headers, authentication, the CSRF
    cookie, and the CSRF check on every request that is not GET, HEAD or OPTIONS."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        credentials: Credentials | None,
        signer: CsrfSigner,
        throttle: LoginThrottle | None = None,
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.signer = signer
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_headers(send, list(SECURITY_HEADERS))
        headers = _headers(scope)
        api = str(scope.get("path", "")).startswith("/api")
        refuse = _json if api else _plain
        if self.credentials is None and not is_loopback(_host_name(headers.get("host"))):
            await refuse(send, 421, "this server answers only loopback host names", [])
            return
        user, retry_after = await self._user(scope, headers)
        if retry_after is not None:
            detail = f"too many failed logins from this address: retry after {retry_after} s"
            await refuse(send, 429, detail, [(b"retry-after", str(retry_after).encode())])
            return
        if user is None:
            challenge = (b"www-authenticate", b'Basic realm="harvest", charset="UTF-8"')
            await refuse(send, 401, "authentication required", [challenge])
            return
        cookie = _cookie(headers.get("cookie"), CSRF_COOKIE)
        token = cookie if cookie is not None and self.signer.valid(cookie, user) else None
        if scope["method"] not in SAFE_METHODS:
            submitted, receive = await self._submitted(scope, headers, receive)
            if submitted is _TOO_LARGE:
                await refuse(send, 413, "form too large", [])
                return
            if (
                token is None
                or not isinstance(submitted, str)
                or not hmac.compare_digest(submitted.encode(), token.encode())
            ):
                detail = (
                    "CSRF check failed: send the token of the harvest_csrf cookie as the "
                    "X-CSRF-Token header (GET /api/csrf gives one), or reload the page"
                )
                await refuse(send, 403, detail, [])
                return
        if token is None:
            token = self.signer.new_token(user)
            cookie_value = f"{CSRF_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
            send = _with_headers(send, [(b"set-cookie", cookie_value.encode())])
        state = scope.setdefault("state", {})
        state["user"] = user
        state["csrf_token"] = token
        await self.app(scope, receive, send)

    async def _user(self, scope: Scope, headers: dict[str, str]) -> tuple[str | None, int | None]:
        """(the user let in or None, seconds to wait when the address is locked). Only
        well-formed Basic credentials are an attempt (judged by the throttle); no or garbled
        credentials are refused (401) without counting."""
        if self.credentials is None:
            return "anonymous", None
        given = _basic_auth(headers.get("authorization"))
        if given is None:
            return None, None
        right = self.credentials.check(*given)
        if self.throttle is not None:
            client = scope.get("client")
            verdict = await self.throttle.attempt(
                client[0] if client else None, given[0], right=right
            )
            if verdict.retry_after is not None:
                return None, verdict.retry_after
        return (given[0] if right else None), None

    async def _submitted(
        self, scope: Scope, headers: dict[str, str], receive: Receive
    ) -> tuple[str | object | None, Receive]:
        """The token sent with an unsafe request (header, else form field), and a receive
        that replays the body when it had to be read."""
        if CSRF_HEADER in headers:
            return headers[CSRF_HEADER], receive
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/x-www-form-urlencoded":
            return None, receive
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None, receive
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > MAX_FORM_BYTES:
                return _TOO_LARGE, receive
        fields = parse_qs(bytes(body).decode("utf-8", "replace"), max_num_fields=100)
        values = fields.get(CSRF_FIELD)
        return (values[0] if values else None), _replay(bytes(body), receive)


_TOO_LARGE = object()


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            present = {name.lower() for name, _ in message.get("headers", [])}
            message["headers"] = [
                *message.get("headers", []),
                *((n, v) for n, v in extra if n == b"set-cookie" or n not in present),
            ]
        await send(message)

    return wrapped
