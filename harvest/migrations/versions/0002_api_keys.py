"""API keys: pools of keys whose secrets are stored encrypted (Fernet)

Revision ID: 0002_api_keys
Revises: 0001_jobs
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_api_keys"
down_revision = "0001_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "harvest_api_keys",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("pool", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("secret_encrypted", sa.LargeBinary(), nullable=False),
        sa.Column("secret_hint", sa.Text(), nullable=False),
        sa.Column("max_concurrency", sa.Integer(), server_default="1", nullable=False),
        sa.Column("rate_limit", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), server_default="active", nullable=False),
        sa.Column("cooldown_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.UniqueConstraint("pool", "name", name="harvest_api_keys_pool_name_key"),
        sa.CheckConstraint("max_concurrency >= 1", name="harvest_api_keys_max_concurrency_check"),
        sa.CheckConstraint(
            "status IN ('active', 'cooling', 'disabled')", name="harvest_api_keys_status_check"
        ),
    )


def downgrade() -> None:
    op.drop_table("harvest_api_keys")
