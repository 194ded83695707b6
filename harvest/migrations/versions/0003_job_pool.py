"""jobs remember the key pool that gates them (capacity-aware dispatch)

Revision ID: 0003_job_pool
Revises: 0002_api_keys
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_job_pool"
down_revision = "0002_api_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: a metadata-only change, no table rewrite on a large queue.
    op.add_column("harvest_jobs", sa.Column("pool", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("harvest_jobs", "pool")
