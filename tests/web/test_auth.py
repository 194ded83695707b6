"""Security of the running dashboard: no request without credentials, no POST without the
CSRF token, no start without credentials (except loopback, explicitly), safe headers."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer
from fastapi.routing import APIRoute
from pydantic import SecretStr
from sqlalchemy import Engine
from typer.testing import CliRunner

from harvest.app import Harvest
from harvest.errors import ConfigurationError
from harvest.settings import Settings
from harvest.web import api, auth, create_app, pages
from tests.web.conftest import Server, Web, csrf_token
from tests.web.helpers import db_status, end_as, forget_logins

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def routes() -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled in, plus static files,
    the OpenAPI document and a path that does not exist."""
    found = [
        ("GET", "/static/app.css"),
        ("GET", "/static/live.js"),
        ("GET", "/api/openapi.json"),
        ("GET", "/nope"),
        ("POST", "/nope"),
    ]
    for route in [*api.router.routes, *pages.router.routes]:
        assert isinstance(route, APIRoute)
        path = re.sub(r"\{[^}]+\}", "1", route.path)
        found += [(method, path) for method in sorted(route.methods)]
    assert len([r for r in found if r[1].startswith("/api/")]) >= 18
    assert ("POST", "/keys/1/disable") in found and ("GET", "/api/openapi.json") in found
    return found


def _basic(user: str, password: str) -> dict[str, str]:
    value = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {value}"}


def test_every_page_and_api_route_refuses_requests_without_credentials(
    web: Web, routes: list[tuple[str, str]], migrated: Settings
) -> None:
    wrong = [
        {},
        _basic(web.user, web.password + "x"),
        _basic(web.user.upper(), web.password),
        _basic(web.user, ""),
        {"Authorization": "Bearer " + web.password},
        {"Authorization": "Basic not-base64!"},
    ]
    with httpx.Client(base_url=web.url) as client:
        for method, path in routes:
            for headers in wrong:
                response = client.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"].startswith("Basic")
                assert "set-cookie" not in response.headers
            forget_logins(migrated.redis_url)  # 3 wrong guesses a route: not throttled here
        ok = client.get("/api/overview", headers=_basic(web.user, web.password))
        assert ok.status_code == 200


def test_posts_without_the_csrf_token_are_refused(
    web: Web, routes: list[tuple[str, str]], harvest: Harvest, clean_db: Engine
) -> None:
    ref = harvest.enqueue("web_flaky", {"note": "csrf"})
    end_as(clean_db, [ref.id], "failed", "RuntimeError: down")
    posts = [path.replace("/1/", f"/{ref.id}/") for m, path in routes if m == "POST"]
    assert len(posts) >= 15
    with web.client() as client:
        token = csrf_token(client)
        forged = token.split(".")[0] + "." + "A" * 43
        for path in posts:
            refused = [
                client.post(path),
                client.post(path, data={"csrf_token": ""}),
                client.post(path, data={"csrf_token": forged}),
                client.post(path, headers={"X-CSRF-Token": forged}),
                client.post(path, headers={"X-CSRF-Token": token + "x"}),
            ]
            for response in refused:
                assert response.status_code == 403, path
        # The right token, but without its cookie (a fresh client): refused as well.
        with web.client() as other:
            assert (
                other.post(f"/api/jobs/{ref.id}/retry", headers={"X-CSRF-Token": token}).status_code
                == 403
            )
        assert db_status(clean_db, ref.id) == "failed"  # nothing happened
        # The token of the page (form field) and of the API (header) both work.
        done = client.post(f"/jobs/{ref.id}/retry", data={"csrf_token": token})
        assert done.status_code == 303 and db_status(clean_db, ref.id) == "pending"
        assert (
            client.post(f"/api/jobs/{ref.id}/cancel", headers={"X-CSRF-Token": token}).status_code
            == 200
        )


def test_a_token_is_bound_to_the_server_secret_and_user() -> None:
    one = auth.CsrfSigner.for_credentials(auth.Credentials("a", SecretStr("password-1")))
    two = auth.CsrfSigner.for_credentials(auth.Credentials("a", SecretStr("password-2")))
    token = one.new_token("a")
    assert one.valid(token, "a")
    assert not one.valid(token, "b")
    assert not two.valid(token, "a")
    assert not one.valid(token.replace(".", ""), "a")
    assert not one.valid(None, "a")


def test_every_response_carries_safe_headers_and_an_httponly_strict_cookie(web: Web) -> None:
    with web.client() as client:
        response = client.get("/")
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith("harvest_csrf=") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie


def test_without_auth_it_answers_only_loopback_host_names(migrated: Settings) -> None:
    with Server(create_app(migrated, credentials=None)) as server, httpx.Client() as client:
        assert client.get(f"{server.url}/api/overview").status_code == 200
        for host in ("localhost", f"localhost:{server.port}", "[::1]:80"):
            response = client.get(f"{server.url}/api/csrf", headers={"Host": host})
            assert response.status_code == 200, host
        for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
            response = client.get(f"{server.url}/", headers={"Host": host})
            assert response.status_code == 421, host


# --- starting it ------------------------------------------------------------------------------


def test_credentials_are_required_and_checked() -> None:
    assert auth.credentials_from(auth.WebSettings(user=None, password=None)) is None
    refused = [
        ("admin", None),
        (None, "long-enough-password"),
        ("admin", "s3cr3t"),
        ("ad:min", "long-enough-password"),
        ("  ", "long-enough-password"),
        ("admin", " " * 8),
        ("admin", "\t \n \u3000\u00a0   "),
    ]
    for user, password in refused:
        with pytest.raises(ConfigurationError) as caught:
            auth.credentials_from(auth.WebSettings(user=user, password=password))
        assert password is None or password not in str(caught.value)
    made = auth.credentials_from(auth.WebSettings(user="admin", password="long-enough-password"))
    assert made is not None and made.check("admin", "long-enough-password")
    assert not made.check("admin", "long-enough-passworD")
    assert "long-enough" not in repr(made)


@pytest.mark.parametrize(
    ("host", "with_credentials", "insecure", "allowed"),
    [
        ("127.0.0.1", True, False, True),
        ("0.0.0.0", True, False, True),
        ("127.0.0.1", False, False, False),
        ("127.0.0.1", False, True, True),
        ("localhost", False, True, True),
        ("::1", False, True, True),
        ("0.0.0.0", False, True, False),
        ("192.168.1.5", False, True, False),
        ("0.0.0.0", True, True, False),
    ],
)
def test_it_refuses_to_start_without_auth_unless_loopback_and_told(
    host: str, with_credentials: bool, insecure: bool, allowed: bool
) -> None:
    credentials = auth.Credentials("admin", SecretStr("long-enough-password"))
    args = (host, credentials if with_credentials else None)
    if allowed:
        auth.check_bind(*args, insecure_no_auth=insecure)
    else:
        with pytest.raises(ConfigurationError):
            auth.check_bind(*args, insecure_no_auth=insecure)


def test_the_command_refuses_without_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    from harvest.cli_web import web_command

    monkeypatch.delenv("HARVEST_WEB_USER", raising=False)
    monkeypatch.delenv("HARVEST_WEB_PASSWORD", raising=False)
    cli = typer.Typer()
    cli.command()(web_command)
    result = CliRunner().invoke(cli, ["--port", "1"])
    assert isinstance(result.exception, ConfigurationError)
    assert "HARVEST_WEB_PASSWORD" in str(result.exception)
    result = CliRunner().invoke(cli, ["--host", "0.0.0.0", "--insecure-no-auth"])
    assert isinstance(result.exception, ConfigurationError)
    assert "only allowed on loopback" in str(result.exception)


def test_a_password_of_only_whitespace_is_refused_at_start_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from harvest.cli import main

    monkeypatch.setenv("HARVEST_WEB_USER", "admin")
    monkeypatch.setenv("HARVEST_WEB_PASSWORD", " " * 8)
    monkeypatch.setattr(sys, "argv", ["harvest", "web", "--port", "1"])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: HARVEST_WEB_PASSWORD is only whitespace: use at least 8 characters that are "
        "not all spaces"
    ]


@pytest.fixture
def served(migrated: Settings) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "HARVEST_WEB_USER": "operator",
        "HARVEST_WEB_PASSWORD": "a-long-test-password",
        "PATH": "/usr/bin:/bin",
    }
    code = "import typer; from harvest.cli_web import web_command; typer.run(web_command)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    yield proc, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.mark.slow
def test_the_command_serves_on_loopback_with_auth(
    served: tuple[subprocess.Popen[bytes], str],
) -> None:
    import time

    proc, url = served
    deadline = time.monotonic() + 20
    with httpx.Client(base_url=url) as client:
        while True:
            try:
                response = client.get("/api/overview")
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "harvest web did not start"
                time.sleep(0.2)
        assert response.status_code == 401
        ok = client.get("/api/overview", auth=("operator", "a-long-test-password"))
        assert ok.status_code == 200
        assert "server" not in ok.headers  # uvicorn's banner is off
    proc.terminate()
    output = proc.communicate(timeout=10)[0].decode()
    assert f"harvest web on {url}/" in output
    assert "a-long-test-password" not in output
