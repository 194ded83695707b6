"""search jobs by a payload path: a GIN index (jsonb_path_ops) on harvest_jobs.payload

Serves ``payload @> '{"url": "..."}'`` (harvest.search), whatever the table's size. It costs
every enqueue (bench/gin_cost.py measures it); jsonb_path_ops is the smaller and cheaper of
the two GIN operator classes, and containment is the only operator search uses. Built
CONCURRENTLY, outside the migration's transaction: a busy table keeps taking jobs meanwhile.

Revision ID: 0010_job_payload_index
Revises: 0009_queue_pause
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0010_job_payload_index"
down_revision = "0009_queue_pause"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS harvest_jobs_payload_idx "
            "ON harvest_jobs USING gin (payload jsonb_path_ops)"
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS harvest_jobs_payload_idx")
