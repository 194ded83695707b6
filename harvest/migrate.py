"""Alembic, driven from Python: every schema change is a revision in
``harvest/migrations/versions``, shipped inside the package (Alembic finds it as a package
resource, so an installed wheel migrates)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from harvest.settings import Settings

VERSION_TABLE = "harvest_alembic_version"
SCRIPT_LOCATION = "harvest:migrations"  # Alembic's package-resource form


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser interpolation: a literal % in the URL must be doubled.
    url = settings.migration_settings().database_url
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
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


def behind(settings: Settings, revision: str) -> str | None:
    """The head this version of harvest needs, when the database at ``revision`` is older;
    None when it is at the head, or at a revision this version does not know (a newer harvest
    migrated it: older code keeps working on a newer schema during a rolling deploy)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    scripts = ScriptDirectory.from_config(alembic_config(settings))
    head = scripts.get_current_head()
    if head is None or revision == head:
        return None
    try:
        scripts.get_revision(revision)
    except CommandError:
        return None
    return head
