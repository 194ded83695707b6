"""HARVEST_DATABASE_POOLER and HARVEST_DATABASE_DIRECT_URL: what a connection carries behind a
transaction-mode pooler, and where migrations go."""

from __future__ import annotations

import pytest

from harvest.db import connect_options
from harvest.errors import ConfigurationError
from harvest.settings import Settings, load_settings

POOLED = "postgresql+psycopg://app@pgbouncer:6432/harvest"
DIRECT = "postgresql+psycopg://app:s3cret@db:5432/harvest"


def test_direct_connections_carry_the_server_side_timeouts() -> None:
    options = connect_options(Settings(statement_timeout_ms=1234))
    assert "-c statement_timeout=1234" in options["options"]
    assert "prepare_threshold" not in options  # psycopg's default: prepare after 5 runs


def test_behind_a_transaction_pooler_nothing_outlives_a_transaction() -> None:
    options = connect_options(Settings(database_url=POOLED, database_pooler="transaction"))
    assert "options" not in options  # PgBouncer refuses the startup parameter
    assert options["prepare_threshold"] is None  # psycopg prepares nothing
    assert options["application_name"] == "harvest"


def test_migrations_go_to_the_direct_url_without_the_pooler() -> None:
    settings = Settings(
        database_url=POOLED, database_pooler="transaction", database_direct_url=DIRECT
    )
    direct = settings.migration_settings()
    assert direct.database_url == DIRECT
    assert not direct.pooled
    assert direct.database_direct_url is None
    assert "-c statement_timeout" in connect_options(direct)["options"]


def test_without_a_direct_url_migrations_use_the_pooled_url() -> None:
    settings = Settings(database_url=POOLED, database_pooler="transaction")
    assert settings.migration_settings() == settings


def test_direct_url_takes_the_plain_postgresql_scheme() -> None:
    settings = Settings(database_direct_url="postgresql://app@db:5432/harvest")
    assert settings.database_direct_url == "postgresql+psycopg://app@db:5432/harvest"


def test_an_unknown_pooler_mode_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARVEST_DATABASE_POOLER", "session")
    with pytest.raises(ConfigurationError, match="HARVEST_DATABASE_POOLER"):
        load_settings()


def test_a_bad_direct_url_is_refused_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HARVEST_DATABASE_DIRECT_URL", "mysql://app:s3cret@db/harvest")
    with pytest.raises(ConfigurationError, match="HARVEST_DATABASE_DIRECT_URL") as err:
        load_settings()
    assert "s3cret" not in str(err.value)
