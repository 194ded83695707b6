"""Alembic environment: the URL comes from harvest's settings (HARVEST_DATABASE_URL)."""

from __future__ import annotations

from sqlalchemy import create_engine, pool

from alembic import context
from harvest.migrate import VERSION_TABLE
from harvest.models import Base
from harvest.settings import Settings

config = context.config
settings = config.attributes.get("harvest_settings") or Settings()


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
    engine = create_engine(settings.database_url, poolclass=pool.NullPool)
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
