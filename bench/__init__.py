"""harvest's benchmarks: harvest side by side with plain Celery, raw SQL, procrastinate and
PgQueuer, in one run on one machine.

``python -m bench`` runs every scenario (``--quick`` for a small smoke run, ``--only e2e,claim``
to pick some), prints a table of medians with min and max and each target, and writes
``bench/results/latest.json``. Each scenario gets a fresh Postgres database and a Redis db
number of its own, and stops every process it started, on failure and on Ctrl-C too.

Modules: ``core`` (results, targets, statistics), ``env`` (services, databases, processes),
``jobs`` (the harvest jobs the workers run), one module per scenario, ``baselines/`` (the plain
Celery app and the procrastinate / PgQueuer workers; for ``goodput``, the asyncio script and
Celery on gevent), ``report`` (table and JSON). ``goodput`` runs against the loopback AI-API
service of ``harvest.loopback``; its subjects are in ``goodput_subjects``.
"""
