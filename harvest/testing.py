"""Run harvest jobs in your own tests: in-process, synchronously, against a real Postgres, with
the same validation, retries and outcomes as a worker (the worker's own Runner runs them).

With pytest::

    # conftest.py
    pytest_plugins = ["harvest.testing"]

    # test_myjobs.py
    def test_fetch_page(harvest_testing):
        app = harvest_testing.use(myjobs.app)   # your app, on a fresh migrated database
        ref = myjobs.fetch_page.enqueue(url="https://example.org")
        harvest_testing.run_pending()           # what a worker would do, here and now
        assert app.get(ref.id).status == "succeeded"

The plugin creates one database per test session, ``<your database>_test_<random>``, on the
server of ``HARVEST_DATABASE_URL`` (the role needs CREATEDB), migrates it, empties harvest's
tables before each test and drops the database at the end. Nothing is published to the broker:
nudges are off for the apps a test uses. Jobs with a ``pool`` or a ``rate_limit`` take their
key lease and permits from the Redis of ``HARVEST_REDIS_URL``, as a worker does.

Without pytest, :func:`run_pending` runs the due jobs of any Harvest app.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from importlib.util import find_spec

import psycopg
from psycopg import sql

from harvest import migrate, store
from harvest.app import Harvest
from harvest.db import make_engine
from harvest.jobs import Job
from harvest.settings import Settings, load_settings

CLAIM = 100  # jobs claimed per round
TTL = 300.0  # seconds a claimed job's dispatch lease lasts (nothing rescues it here anyway)


def run_pending(
    app: Harvest, *, retries: bool = True, delayed: bool = False, limit: int = 10_000
) -> list[Job]:
    """Run ``app``'s due jobs in this process, one at a time, until none is due; return them
    (each once, in the order they first ran) as they are now.

    :param retries: run a job's retries at once instead of after their backoff, until it
        succeeds or runs out of attempts (True), or leave them pending (False).
    :param delayed: run jobs enqueued with a delay or run_at in the future too.
    :param limit: most attempts to run in all (a bound on jobs that keep retrying).
    """
    from harvest.runner import Runner

    runner = Runner(app)
    ran: dict[int, None] = {}
    attempts = 0
    try:
        while attempts < limit:
            with app.engine.begin() as conn:
                if retries or delayed:
                    store.make_due(conn, delayed=delayed)
                claimed = store.claim_due(conn, limit=min(CLAIM, limit - attempts), ttl=TTL)
            if not claimed:
                break
            for job in claimed:
                runner.execute([[job.id, str(job.token), job.name]])
                ran.setdefault(job.id)
            attempts += len(claimed)
    finally:
        runner.close()
    return [app.get(job_id) for job_id in ran]


class HarvestTesting:
    """What the ``harvest_testing`` fixture gives a test: :meth:`use` your app on the test
    database, :meth:`run_pending` to run its jobs. Everything is put back after the test."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._used: list[tuple[Harvest, Settings]] = []

    def use(self, app: Harvest) -> Harvest:
        """Point ``app`` at the test database (nudges off) until the test ends; returns it."""
        if all(app is not used for used, _ in self._used):
            self._used.append((app, app.settings))
            app.close()
            app.settings = self._settings(app.settings)
            app.nudge = _no_nudge  # type: ignore[method-assign]
        return app

    def run_pending(
        self, *, retries: bool = True, delayed: bool = False, limit: int = 10_000
    ) -> list[Job]:
        """Run the due jobs of every app :meth:`use` was given, as one worker that imports
        them all would (see :func:`run_pending` for the options)."""
        if not self._used:
            raise RuntimeError("call harvest_testing.use(app) with your Harvest app first")
        worker = Harvest(self._settings(self._used[0][1]))
        worker.nudge = _no_nudge  # type: ignore[method-assign]
        for app, _ in self._used:
            worker.jobs.update(app.jobs)
        try:
            return run_pending(worker, retries=retries, delayed=delayed, limit=limit)
        finally:
            worker.close()

    def empty(self) -> None:
        """Empty harvest's tables (every test starts with none of them holding rows)."""
        engine = make_engine(Settings(database_url=self.database_url), pool_size=1)
        try:
            with engine.begin() as conn:
                store.empty_tables(conn)
        finally:
            engine.dispose()

    def restore(self) -> None:
        """Put every app back as it was."""
        for app, settings in reversed(self._used):
            app.close()
            app.settings = settings
            with contextlib.suppress(AttributeError):
                del app.nudge
        self._used.clear()

    def _settings(self, settings: Settings) -> Settings:
        return settings.model_copy(update={"database_url": self.database_url})


def _no_nudge() -> None:
    """Tests run jobs with run_pending: nothing goes to the broker."""


@contextlib.contextmanager
def fresh_database(settings: Settings | None = None) -> Iterator[str]:
    """A fresh database ``<name>_test_<random>`` on the server of ``settings.database_url``,
    migrated; yields its URL and drops it after."""
    settings = (settings or load_settings()).migration_settings()  # the server, not a pooler
    base, name = settings.database_url.rsplit("/", 1)
    fresh = f"{name.split('?', 1)[0]}_test_{secrets.token_hex(4)}"[:63]
    admin = psycopg.conninfo.make_conninfo(settings.psycopg_url, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(fresh)))
    url = f"{base}/{fresh}"
    try:
        migrate.upgrade(settings.model_copy(update={"database_url": url}))
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
            conn.execute(drop.format(sql.Identifier(fresh)))


if find_spec("pytest") is not None:  # the fixtures, for pytest_plugins = ["harvest.testing"]
    import pytest

    @pytest.fixture(scope="session")
    def harvest_database() -> Iterator[str]:
        """The URL of a fresh, migrated database for this test session, dropped at its end."""
        with fresh_database() as url:
            yield url

    @pytest.fixture
    def harvest_testing(harvest_database: str) -> Iterator[HarvestTesting]:
        """Run jobs in this test: ``harvest_testing.use(app)``, then ``.run_pending()``.
        harvest's tables are empty when the test starts; the apps it used are put back after
        it."""
        testing = HarvestTesting(harvest_database)
        testing.empty()
        yield testing
        testing.restore()
