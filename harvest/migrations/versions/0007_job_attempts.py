"""each job keeps the history of its last attempts (start, end, worker, outcome, error)

One row per attempt that ended, written by a trigger when a job leaves ``running`` (every path
that ends an attempt: a worker's fenced finish, a grouped finish, rescue of a dead worker's
job, a cancel), so no writer can forget it. The last ``KEEP`` attempts of a job are kept;
they go with the job (ON DELETE CASCADE), so pruning finished jobs prunes their history.

Revision ID: 0007_job_attempts
Revises: 0006_job_deferred_since
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_job_attempts"
down_revision = "0006_job_deferred_since"
branch_labels = None
depends_on = None

KEEP = 20  # attempts kept per job

FUNCTION = f"""
CREATE FUNCTION harvest_record_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO harvest_job_attempts
        (job_id, attempt, worker, started_at, ended_at, outcome, error)
    VALUES (
        OLD.id, OLD.attempts, OLD.worker, OLD.started_at, now(),
        CASE NEW.status WHEN 'pending' THEN 'retry' ELSE NEW.status END,
        CASE WHEN NEW.status = 'succeeded' THEN NULL ELSE left(NEW.last_error, 2000) END
    );
    IF OLD.attempts > {KEEP} THEN
        DELETE FROM harvest_job_attempts
        WHERE job_id = OLD.id AND attempt <= OLD.attempts - {KEEP};
    END IF;
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "harvest_job_attempts",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), primary_key=True),
        sa.Column(
            "job_id",
            sa.BigInteger(),
            sa.ForeignKey("harvest_jobs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
    )
    # Not unique: an attempt refunded (a key's fault) is tried again under the same number.
    op.create_index("harvest_job_attempts_job_idx", "harvest_job_attempts", ["job_id", "attempt"])
    op.execute(FUNCTION)
    op.execute(
        """
        CREATE TRIGGER harvest_jobs_attempt_ended
        AFTER UPDATE OF status ON harvest_jobs
        FOR EACH ROW
        WHEN (OLD.status = 'running' AND NEW.status <> 'running')
        EXECUTE FUNCTION harvest_record_attempt()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS harvest_jobs_attempt_ended ON harvest_jobs")
    op.execute("DROP FUNCTION IF EXISTS harvest_record_attempt()")
    op.drop_table("harvest_job_attempts")
