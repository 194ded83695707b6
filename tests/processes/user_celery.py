"""A project's own Celery app, with its own tasks, queue and configuration, that harvest is
installed into (``celery -A tests.processes.user_celery worker|beat``)."""

from __future__ import annotations

import os

import psycopg
from celery import Celery

import harvest

app = Celery("userproj", broker=os.environ["HARVEST_REDIS_URL"], set_as_current=False)
app.conf.update(
    task_default_queue="user",
    task_routes={"userproj.*": {"queue": "user"}},
    worker_prefetch_multiplier=4,
    task_acks_late=False,
    timezone="Europe/Paris",
    beat_schedule={"user-heartbeat": {"task": "userproj.heartbeat", "schedule": 1.0}},
)
BEFORE = {key: app.conf[key] for key in app.conf}  # the test checks install() kept these


def _effect(job_id: int) -> None:
    url = os.environ["HARVEST_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO test_effects (job_id, attempt, pid) VALUES (%s, 0, %s)",
            (job_id, os.getpid()),
        )


@app.task(name="userproj.add", shared=False)
def add(x: int, y: int) -> int:
    """The project's own task: records -(x + y) as an effect."""
    _effect(-(x + y))
    return x + y


@app.task(name="userproj.heartbeat", shared=False)
def heartbeat() -> None:
    """The project's own beat entry: records -1 as an effect."""
    _effect(-1)


harvest.install(app)
