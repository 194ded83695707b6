"""jobs remember when a run of deferrals began (no key free, unknown job name, shutdown)

A job deferred without starting keeps the time of its first deferral until it starts; an
execution worker that does not know a job's name defers it without using an attempt for
HARVEST_UNKNOWN_JOB_GRACE seconds from then (a rolling deploy), then fails it.

Revision ID: 0006_job_deferred_since
Revises: 0005_job_worker
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_job_deferred_since"
down_revision = "0005_job_worker"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: a metadata-only change, no table rewrite on a large queue.
    op.add_column(
        "harvest_jobs", sa.Column("deferred_since", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("harvest_jobs", "deferred_since")
