"""jobs remember which worker process runs their current attempt (hostname:pid)

Revision ID: 0005_job_worker
Revises: 0004_flow_control
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_job_worker"
down_revision = "0004_flow_control"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: a metadata-only change, no table rewrite on a large queue.
    op.add_column("harvest_jobs", sa.Column("worker", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("harvest_jobs", "worker")
