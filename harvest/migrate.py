"""Alembic, driven from Python: every schema change is a revision in ``alembic/versions``."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

from alembic import command
from harvest.settings import Settings

VERSION_TABLE = "harvest_alembic_version"
SCRIPT_LOCATION = Path(__file__).resolve().parent.parent / "alembic"


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    # ConfigParser interpolation: a literal % in the URL must be doubled.
    cfg.set_main_option("sqlalchemy.url", settings.database_url.replace("%", "%%"))
    cfg.attributes["harvest_settings"] = settings
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    command.upgrade(alembic_config(settings), revision)


def downgrade(settings: Settings, revision: str = "base") -> None:
    command.downgrade(alembic_config(settings), revision)


def current(settings: Settings) -> str | None:
    from alembic.runtime.migration import MigrationContext

    from harvest.db import make_engine

    engine = make_engine(settings, pool_size=1)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return ctx.get_current_revision()
    finally:
        engine.dispose()
