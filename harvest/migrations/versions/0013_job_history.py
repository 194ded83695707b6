"""a partitioned history of finished jobs, dropped whole by retention

``harvest_job_history`` holds jobs that ended: the columns of ``harvest_jobs`` as they were when
the job moved, plus ``attempt_log`` (its recorded attempts, from ``harvest_job_attempts``) and
``moved_at``. It is partitioned by LIST on ``status`` into ``harvest_job_history_done``
(succeeded, cancelled) and ``harvest_job_history_dead`` (failed), each partitioned by RANGE on
``finished_at`` into UTC days (``harvest_job_history_done_20261124``), so that each kind keeps
its own retention and retention drops a day whole: no DELETE, no dead tuples, no vacuum.

Maintenance moves jobs that ended more than ``HARVEST_HISTORY_AFTER`` seconds ago in batches
(one statement each: ``DELETE ... RETURNING`` from ``harvest_jobs`` feeding an ``INSERT`` into
the history) and makes the day partitions it needs then (:mod:`harvest.store.history_rows`).
``harvest_jobs_all`` (a view, ``UNION ALL``) is what every reader of jobs reads; a job is in
exactly one of the two tables at any instant.

Online: this migration only makes new, empty objects (and takes no lock on ``harvest_jobs``
beyond the view's brief share lock); the finished rows already in ``harvest_jobs`` move in
later batches, each a short transaction that skips locked rows, while workers run.

Revision ID: 0013_job_history
Revises: 0012_usage
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0013_job_history"
down_revision = "0012_usage"
branch_labels = None
depends_on = None

# The columns of harvest_jobs at this revision, in order. A later migration that adds a column
# to harvest_jobs adds it to harvest_job_history and to the view too.
COLUMNS = (
    "id, name, queue, payload, status, priority, run_at, attempts, max_attempts, timeout, "
    "lease_token, lease_expires_at, idempotency_key, result, last_error, last_traceback, "
    "cancel_requested, created_at, dispatched_at, started_at, finished_at, pool, batch_id, "
    "worker, deferred_since, tenant"
)

KINDS = {"done": "'succeeded', 'cancelled'", "dead": "'failed'"}


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE harvest_job_history (
            LIKE harvest_jobs INCLUDING DEFAULTS,
            attempt_log jsonb,
            moved_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT harvest_job_history_finished_check CHECK (finished_at IS NOT NULL)
        ) PARTITION BY LIST (status)
        """
    )
    for kind, statuses in KINDS.items():
        op.execute(
            f"CREATE TABLE harvest_job_history_{kind} PARTITION OF harvest_job_history "
            f"FOR VALUES IN ({statuses}) PARTITION BY RANGE (finished_at)"
        )
    # Partitioned indexes: each day partition gets its own, made when it is.
    op.execute("CREATE INDEX harvest_job_history_id_idx ON harvest_job_history (id)")
    op.execute("CREATE INDEX harvest_job_history_finished_idx ON harvest_job_history (finished_at)")
    op.execute("CREATE INDEX harvest_job_history_name_idx ON harvest_job_history (status, name)")
    op.execute(
        "CREATE INDEX harvest_job_history_batch_idx ON harvest_job_history (batch_id) "
        "WHERE batch_id IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX harvest_job_history_idempotency_key_idx ON harvest_job_history "
        "(idempotency_key) WHERE idempotency_key IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX harvest_job_history_payload_idx ON harvest_job_history "
        "USING gin (payload jsonb_path_ops)"
    )
    op.execute(
        f"CREATE VIEW harvest_jobs_all AS SELECT {COLUMNS} FROM harvest_jobs "
        f"UNION ALL SELECT {COLUMNS} FROM harvest_job_history"
    )


def downgrade() -> None:
    # Jobs in the history go back to harvest_jobs first (their attempts stay in attempt_log).
    op.execute(
        f"INSERT INTO harvest_jobs ({COLUMNS}) SELECT {COLUMNS} FROM harvest_job_history "
        "ON CONFLICT DO NOTHING"
    )
    op.execute("DROP VIEW IF EXISTS harvest_jobs_all")
    op.execute("DROP TABLE IF EXISTS harvest_job_history CASCADE")
