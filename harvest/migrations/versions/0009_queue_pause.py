"""paused queues: dispatch claims none of a paused queue's jobs

One row per paused queue (its name and when it was paused). The claim reads this table in the
same statement that locks the due rows (``queue <> ALL(ARRAY(SELECT queue FROM
harvest_queue_pauses))``), so a pause holds across restarts and for every dispatcher at once.
Pausing is an insert, resuming a delete: each one statement.

Revision ID: 0009_queue_pause
Revises: 0008_key_tpm
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_queue_pause"
down_revision = "0008_key_tpm"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "harvest_queue_pauses",
        sa.Column("queue", sa.Text(), primary_key=True),
        sa.Column(
            "paused_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
    )


def downgrade() -> None:
    op.drop_table("harvest_queue_pauses")
