"""The Celery side of harvest: ``celery -A workers worker -Q execution`` (or ``-Q schedule``),
and ``celery -A workers beat``."""

from workers.celery_app import app

__all__ = ["app"]
