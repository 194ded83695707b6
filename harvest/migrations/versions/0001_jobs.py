"""jobs and counters

Revision ID: 0001_jobs
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_jobs"
down_revision = None
branch_labels = None
depends_on = None

# A hot queue table: every row is updated several times and later deleted by retention. Vacuum
# it early and often so dead tuples do not pile up in front of the claim index, and leave free
# space on each page (fillfactor) so a row's new versions can stay on its page.
AUTOVACUUM = (
    "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0, "
    "autovacuum_vacuum_insert_scale_factor = 0.05, fillfactor = 80"
)


def upgrade() -> None:
    op.create_table(
        "harvest_jobs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), server_default="execution", nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column(
            "run_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="3", nullable=False),
        sa.Column("timeout", sa.Float(), nullable=True),
        sa.Column("lease_token", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("result", postgresql.JSONB(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_traceback", sa.Text(), nullable=True),
        sa.Column(
            "cancel_requested", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'dispatched', 'running', 'succeeded', 'failed', 'cancelled')",
            name="harvest_jobs_status_check",
        ),
        sa.CheckConstraint("max_attempts >= 1", name="harvest_jobs_max_attempts_check"),
    )
    op.create_index(
        "harvest_jobs_claim_idx",
        "harvest_jobs",
        [sa.text("priority DESC"), "run_at", "id"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "harvest_jobs_lease_idx",
        "harvest_jobs",
        ["lease_expires_at"],
        postgresql_where=sa.text("status IN ('dispatched', 'running')"),
    )
    op.create_index(
        "harvest_jobs_idempotency_key_idx",
        "harvest_jobs",
        ["idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_index("harvest_jobs_status_name_idx", "harvest_jobs", ["status", "name"])
    op.execute(f"ALTER TABLE harvest_jobs SET ({AUTOVACUUM})")

    op.create_table(
        "harvest_counters",
        sa.Column("name", sa.Text(), primary_key=True),
        sa.Column("value", sa.BigInteger(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_table("harvest_counters")
    op.drop_table("harvest_jobs")
