"""API keys may declare a token budget: tokens per minute (NULL: no budget)

Revision ID: 0008_key_tpm
Revises: 0007_job_attempts
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_key_tpm"
down_revision = "0007_job_attempts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: a metadata-only change, no table rewrite.
    op.add_column("harvest_api_keys", sa.Column("tpm", sa.BigInteger(), nullable=True))
    op.create_check_constraint("harvest_api_keys_tpm_check", "harvest_api_keys", "tpm >= 1")


def downgrade() -> None:
    op.drop_constraint("harvest_api_keys_tpm_check", "harvest_api_keys", type_="check")
    op.drop_column("harvest_api_keys", "tpm")
