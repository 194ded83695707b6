"""harvest web: the dashboard and JSON API (``harvest web``), reading through the library."""

from harvest.web.app import create_app

__all__ = ["create_app"]
