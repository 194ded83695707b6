"""Alembic environment: the URL comes from harvest's settings (HARVEST_DATABASE_DIRECT_URL when
set, else HARVEST_DATABASE_URL)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from harvest.migrate import VERSION_TABLE
from harvest.models import Base
from harvest.settings import Settings

config = context.config
settings = (config.attributes.get("harvest_settings") or Settings()).migration_settings()


def run_migrations_offline() -> None:
    context.configure(
        url=settings.database_url,
        target_metadata=Base.metadata,
        literal_binds=True,
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # Through a transaction-mode pooler (no direct URL given), nothing may be prepared.
    connect_args = {"prepare_threshold": None} if settings.pooled else {}
    engine = create_engine(
        settings.database_url, poolclass=pool.NullPool, connect_args=connect_args
    )
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            version_table=VERSION_TABLE,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
