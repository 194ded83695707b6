"""The systems harvest is measured against, each run as its own user would run it:

- ``celery_app``: a plain Celery app (same Redis broker, ``acks_late``, no result backend),
  started as ``celery -A bench.baselines.celery_app worker``;
- ``procrastinate_worker``: procrastinate's async worker on the same Postgres;
- ``pgqueuer_worker``: PgQueuer's queue manager on the same Postgres.

Worker scripts read their settings from ``BENCH_*`` environment variables and print
``bench-ready`` once they are taking jobs.
"""
