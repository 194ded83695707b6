"""harvest's Celery app: ``celery -A harvest.worker worker -Q execution`` (or ``-Q schedule``),
and ``celery -A harvest.worker beat``. To attach harvest to a Celery app you already have, see
:func:`harvest.install`."""

from harvest.worker.app import app

celery = app

__all__ = ["app", "celery"]
