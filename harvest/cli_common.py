"""What the ``harvest`` command modules (``harvest/cli*.py``) share: the two consoles, the
lazy import that keeps ``--help`` quick, the settings and the app, and how durations show.

The underscored names are the command modules' own, not harvest's API."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rich.console import Console

from harvest.redact import redact_text

if TYPE_CHECKING:
    from harvest.app import Harvest
    from harvest.settings import Settings


class _Lazy:
    """A module imported on first use: `harvest --help` and `--version` import none of these
    (SQLAlchemy, Redis, Celery, the job registry), so they answer at once."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _settings() -> Settings:
    from harvest.settings import load_settings

    return load_settings()


def _app(settings: Settings | None = None) -> Harvest:
    from harvest.app import Harvest

    app = Harvest(settings or _settings())
    app.load_imports()
    return app


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _triple(values: tuple[float, float, float] | None) -> str:
    return " / ".join(_ms(v) for v in values) if values else "-"


def _first_line(exc: BaseException) -> str:
    lines = redact_text(str(exc)).splitlines()
    return lines[0] if lines else type(exc).__name__
