"""This repository's deployment of harvest (the Procfile and docker-compose.yml run
``celery -A workers ...``): harvest's own Celery app, importable from the repository root and
never installed. A project of yours starts ``celery -A harvest.worker`` instead, or attaches
harvest to its own app with :func:`harvest.install`."""

from harvest.worker import app

__all__ = ["app"]
