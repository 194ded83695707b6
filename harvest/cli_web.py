"""``harvest web``: serve the dashboard and its JSON API with uvicorn.

Registered in :mod:`harvest.cli` as ``cli.command("web")(web_command)``. Refuses to start
without ``HARVEST_WEB_USER`` / ``HARVEST_WEB_PASSWORD`` unless bound to loopback with
``--insecure-no-auth``; binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True, highlight=False, soft_wrap=True)


def web_command(
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on. Anything but loopback needs credentials "
            "(and TLS in front: this server speaks plain HTTP)."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8080,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            "--insecure-no-auth", help="Serve without authentication (loopback only; for a laptop)."
        ),
    ] = False,
    request_timeout: Annotated[
        float,
        typer.Option(
            min=0.5,
            max=3600,
            help="Seconds a client has to send a request's headers and body; slower ones "
            "are dropped.",
        ),
    ] = 10.0,
    max_connections: Annotated[
        int,
        typer.Option(
            min=16,
            max=1_000_000,
            help="Open connections at most (also bounded by the open-file limit); beyond it "
            "the connection waiting longest on its client is dropped.",
        ),
    ] = 1000,
) -> None:
    """Serve the dashboard (pages and /api) until SIGTERM or Ctrl-C.

    Credentials come from HARVEST_WEB_USER and HARVEST_WEB_PASSWORD (HTTP Basic auth on every
    page and API call; there is no default password)."""
    from harvest.settings import load_settings
    from harvest.web import auth, serve
    from harvest.web.app import create_app

    credentials = auth.credentials_from(auth.WebSettings())
    auth.check_bind(host, credentials, insecure_no_auth=insecure_no_auth)
    app = create_app(load_settings(), credentials=credentials)
    shown = f"[{host}]" if ":" in host else host
    who = f"user {credentials.user!r}" if credentials else "NO AUTHENTICATION (loopback only)"
    err.print(f"harvest web on http://{shown}:{port}/ ({who})", markup=False)
    if not auth.is_loopback(host):
        err.print("note: plain HTTP on a non-loopback address: put TLS in front", markup=False)
    config = serve.config(
        app, host=host, port=port, request_timeout=request_timeout,
        max_connections=max_connections, log_level="info",
    )  # fmt: skip
    serve.Server(config).run()
