"""scheduling and flow control: recurring schedules and their fire records, batches with a
barrier trigger, the aging (starvation) index, and indexes for depth checks and retention

Revision ID: 0004_flow_control
Revises: 0003_job_pool
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004_flow_control"
down_revision = "0003_job_pool"
branch_labels = None
depends_on = None

TERMINAL = "('succeeded', 'failed', 'cancelled')"

# The barrier. Fires only for batch members whose status enters or leaves a terminal state (the
# trigger's WHEN clause: jobs outside a batch pay nothing). One UPDATE moves the counters; its
# row lock serialises members ending at the same instant on different workers, so exactly one
# of them sees the batch complete, and that one inserts the callback job in its own
# transaction. completed_at gates the callback: it is inserted at most once, ever (a member
# retried after completion moves the counts, not the callback).
BATCH_FUNCTION = """
CREATE FUNCTION harvest_batch_member_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    callback_id bigint;
BEGIN
    UPDATE harvest_batches SET
        succeeded = succeeded + (NEW.status = 'succeeded')::int - (OLD.status = 'succeeded')::int,
        failed = failed + (NEW.status = 'failed')::int - (OLD.status = 'failed')::int,
        cancelled = cancelled + (NEW.status = 'cancelled')::int - (OLD.status = 'cancelled')::int
    WHERE id = NEW.batch_id
    RETURNING * INTO b;
    IF NOT FOUND OR b.completed_at IS NOT NULL
       OR b.succeeded + b.failed + b.cancelled < b.total THEN
        RETURN NULL;
    END IF;
    IF b.callback_name IS NOT NULL THEN
        INSERT INTO harvest_jobs (name, queue, payload, priority, max_attempts, timeout, pool)
        VALUES (b.callback_name, b.callback_queue,
                b.callback_payload || jsonb_build_object(
                    'batch_id', b.id, 'succeeded', b.succeeded,
                    'failed', b.failed, 'cancelled', b.cancelled),
                b.callback_priority, b.callback_max_attempts, b.callback_timeout, b.callback_pool)
        RETURNING id INTO callback_id;
    END IF;
    UPDATE harvest_batches SET completed_at = now(), callback_job_id = callback_id
    WHERE id = b.id;
    RETURN NULL;
END
$$
"""

BATCH_TRIGGER = f"""
CREATE TRIGGER harvest_jobs_batch_member
AFTER UPDATE OF status ON harvest_jobs
FOR EACH ROW
WHEN (NEW.batch_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
      AND (NEW.status IN {TERMINAL} OR OLD.status IN {TERMINAL}))
EXECUTE FUNCTION harvest_batch_member_ended()
"""


def upgrade() -> None:
    op.create_table(
        "harvest_schedules",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column(
            "payload", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("cron", sa.Text(), nullable=True),
        sa.Column("every_seconds", sa.Float(), nullable=True),
        sa.Column("timezone", sa.Text(), server_default="UTC", nullable=False),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("misfire", sa.Text(), server_default="run_once", nullable=False),
        sa.Column("catch_up", sa.Integer(), server_default="1", nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("next_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.UniqueConstraint("name", name="harvest_schedules_name_key"),
        sa.CheckConstraint(
            "(cron IS NULL) <> (every_seconds IS NULL)", name="harvest_schedules_timing_check"
        ),
        sa.CheckConstraint(
            "every_seconds IS NULL OR every_seconds > 0", name="harvest_schedules_every_check"
        ),
        sa.CheckConstraint(
            "misfire IN ('skip', 'run_once', 'catch_up')", name="harvest_schedules_misfire_check"
        ),
        sa.CheckConstraint("catch_up >= 1", name="harvest_schedules_catch_up_check"),
    )
    op.create_index(
        "harvest_schedules_due_idx",
        "harvest_schedules",
        ["next_run_at"],
        postgresql_where=sa.text("enabled"),
    )
    op.create_table(
        "harvest_schedule_fires",
        sa.Column(
            "schedule_id",
            sa.BigInteger(),
            sa.ForeignKey("harvest_schedules.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("fire_at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
    )
    op.create_index("harvest_schedule_fires_fire_at_idx", "harvest_schedule_fires", ["fire_at"])

    op.create_table(
        "harvest_batches",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), server_default="0", nullable=False),
        sa.Column("failed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cancelled", sa.Integer(), server_default="0", nullable=False),
        sa.Column("callback_name", sa.Text(), nullable=True),
        sa.Column("callback_queue", sa.Text(), nullable=True),
        sa.Column(
            "callback_payload",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("callback_priority", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("callback_max_attempts", sa.Integer(), server_default="3", nullable=False),
        sa.Column("callback_timeout", sa.Float(), nullable=True),
        sa.Column("callback_pool", sa.Text(), nullable=True),
        sa.Column("callback_job_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("total >= 1", name="harvest_batches_total_check"),
    )
    op.create_index(
        "harvest_batches_completed_idx",
        "harvest_batches",
        ["completed_at"],
        postgresql_where=sa.text("completed_at IS NOT NULL"),
    )

    # Nullable, no default: metadata-only, no rewrite of a large jobs table.
    op.add_column("harvest_jobs", sa.Column("batch_id", sa.BigInteger(), nullable=True))
    op.create_index(
        "harvest_jobs_batch_idx",
        "harvest_jobs",
        ["batch_id"],
        postgresql_where=sa.text("batch_id IS NOT NULL"),
    )
    # Aging share of the claim: the oldest due pending jobs, whatever their priority.
    op.create_index(
        "harvest_jobs_age_idx",
        "harvest_jobs",
        ["run_at", "id"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    # Depth of a queue (backpressure) without reading the heap of the whole table.
    op.create_index(
        "harvest_jobs_pending_queue_idx",
        "harvest_jobs",
        ["queue"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    # Retention: the oldest finished jobs, found without a scan.
    op.create_index(
        "harvest_jobs_finished_idx",
        "harvest_jobs",
        ["finished_at"],
        postgresql_where=sa.text(f"status IN {TERMINAL}"),
    )
    op.execute(BATCH_FUNCTION)
    op.execute(BATCH_TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS harvest_jobs_batch_member ON harvest_jobs")
    op.execute("DROP FUNCTION IF EXISTS harvest_batch_member_ended()")
    op.drop_index("harvest_jobs_finished_idx", table_name="harvest_jobs")
    op.drop_index("harvest_jobs_pending_queue_idx", table_name="harvest_jobs")
    op.drop_index("harvest_jobs_age_idx", table_name="harvest_jobs")
    op.drop_index("harvest_jobs_batch_idx", table_name="harvest_jobs")
    op.drop_column("harvest_jobs", "batch_id")
    op.drop_table("harvest_batches")
    op.drop_table("harvest_schedule_fires")
    op.drop_table("harvest_schedules")
