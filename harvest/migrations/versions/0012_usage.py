"""usage accounting: requests, tokens, 429s and errors per key per minute, and running totals

``harvest_key_usage`` holds one row per (minute, pool, key, tenant), added to by each worker
process's flush (one ``INSERT ... ON CONFLICT DO UPDATE`` per window, never a write per call);
retention prunes it by ``minute``. ``harvest_key_usage_totals`` holds one row per (pool, key,
tenant) that only grows (the Prometheus counters; never pruned, one row a key).

The tenant dimension is in the tables already, as ``tenant text NOT NULL DEFAULT ''`` inside the
primary keys ('' = no tenant). A nullable column could not be in a primary key, and a unique
index over a NULL never conflicts (NULLs are distinct), so ``ON CONFLICT`` would add a row per
flush instead of adding to one; adding the column later would mean rebuilding both primary
keys. With '' now, jobs that gain a tenant only pass it through.

Revision ID: 0012_usage
Revises: 0011_job_tenant
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_usage"
down_revision = "0011_job_tenant"
branch_labels = None
depends_on = None

COUNTS = ("requests", "tokens", "rate_limited", "errors")


def _counts() -> list[sa.Column[int]]:
    return [sa.Column(name, sa.BigInteger(), server_default="0", nullable=False) for name in COUNTS]


def upgrade() -> None:
    op.create_table(
        "harvest_key_usage",
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("pool", sa.Text(), nullable=False),
        sa.Column("key_id", sa.BigInteger(), nullable=False),
        sa.Column("tenant", sa.Text(), server_default="", nullable=False),
        *_counts(),
        sa.PrimaryKeyConstraint(
            "minute", "pool", "key_id", "tenant", name="harvest_key_usage_pkey"
        ),
    )
    op.create_table(
        "harvest_key_usage_totals",
        sa.Column("pool", sa.Text(), nullable=False),
        sa.Column("key_id", sa.BigInteger(), nullable=False),
        sa.Column("tenant", sa.Text(), server_default="", nullable=False),
        *_counts(),
        sa.PrimaryKeyConstraint("pool", "key_id", "tenant", name="harvest_key_usage_totals_pkey"),
    )


def downgrade() -> None:
    op.drop_table("harvest_key_usage_totals")
    op.drop_table("harvest_key_usage")
