"""Every statement on harvest's job tables.

Each check-and-act is one statement, judged by the database clock (``now()``). Writes that
belong to a running attempt are fenced: ``WHERE id = :id AND lease_token = :token``; a write
that matches no row means the attempt lost its lease, and its outcome is dropped.

The statements are grouped by concern: :mod:`~harvest.store.enqueue` (jobs and batches in,
backpressure depth), :mod:`~harvest.store.claim` (the SKIP LOCKED claim and dispatch figures),
:mod:`~harvest.store.leases` (fenced single-job writes, rescue of expired leases),
:mod:`~harvest.store.reads` (jobs read tolerantly, listings, search), :mod:`~harvest.store.ending`
(cancel, retry, delete, retention, emptying for tests), :mod:`~harvest.store.figures` (counters
and stats), :mod:`~harvest.store.quarantine` (rows harvest cannot read),
:mod:`~harvest.store.queue_rows` (paused queues, queue figures) and
:mod:`~harvest.store.schedule_rows` (recurring schedules' rows). Every public name is
re-exported here: callers write ``store.claim_due(...)``.
"""

from __future__ import annotations

from harvest.jobs import Job  # the value store reads return (store.Job in annotations)
from harvest.store.claim import (
    ClaimWatch,
    aging_share,
    claim_due,
    claim_round,
    in_flight_by_pool,
    inflight,
    recent_run_seconds,
)
from harvest.store.ending import (
    cancel,
    delete_failed,
    delete_failed_many,
    empty_tables,
    make_due,
    prune,
    retry_failed,
    retry_failed_many,
)
from harvest.store.enqueue import (
    BACKSLASH,
    COPY_ROWS_PER_WRITE,
    NewBatch,
    NewJob,
    find_by_idempotency_key,
    get_batch,
    insert_admitted,
    insert_batch,
    insert_job,
    insert_many,
    insert_rows,
    json_value,
    lock_depth,
    pending_depth,
)
from harvest.store.figures import (
    Window,
    bump,
    counters,
    counts_by_status,
    depth,
    minute_rows,
    status_counts,
    window,
)
from harvest.store.leases import (
    Rescued,
    defer,
    finish,
    heartbeat,
    hold,
    rescue_expired,
    start,
)
from harvest.store.quarantine import (
    QUARANTINED,
    READABLE_FROM,
    READABLE_TO,
    Quarantined,
    quarantine,
    quarantine_pending,
)
from harvest.store.queue_rows import (
    Toggled,
    pause_queue,
    paused_queues,
    queue_figures,
    resume_queue,
)
from harvest.store.reads import (
    JOB_STATES,
    get,
    list_batches,
    list_jobs,
    list_jobs_page,
    status_of,
)
from harvest.store.schedule_rows import (
    advance_schedule,
    claim_due_schedule,
    db_now,
    delete_schedule,
    fire_schedule,
    get_or_create_schedule,
    get_schedule,
    list_schedules,
    lock_schedule,
    update_schedule,
)

__all__ = [
    "BACKSLASH",
    "COPY_ROWS_PER_WRITE",
    "JOB_STATES",
    "QUARANTINED",
    "READABLE_FROM",
    "READABLE_TO",
    "ClaimWatch",
    "Job",
    "NewBatch",
    "NewJob",
    "Quarantined",
    "Rescued",
    "Toggled",
    "Window",
    "advance_schedule",
    "aging_share",
    "bump",
    "cancel",
    "claim_due",
    "claim_due_schedule",
    "claim_round",
    "counters",
    "counts_by_status",
    "db_now",
    "defer",
    "delete_failed",
    "delete_failed_many",
    "delete_schedule",
    "depth",
    "empty_tables",
    "find_by_idempotency_key",
    "finish",
    "fire_schedule",
    "get",
    "get_batch",
    "get_or_create_schedule",
    "get_schedule",
    "heartbeat",
    "hold",
    "in_flight_by_pool",
    "inflight",
    "insert_admitted",
    "insert_batch",
    "insert_job",
    "insert_many",
    "insert_rows",
    "json_value",
    "list_batches",
    "list_jobs",
    "list_jobs_page",
    "list_schedules",
    "lock_depth",
    "lock_schedule",
    "make_due",
    "minute_rows",
    "pause_queue",
    "paused_queues",
    "pending_depth",
    "prune",
    "quarantine",
    "quarantine_pending",
    "queue_figures",
    "recent_run_seconds",
    "rescue_expired",
    "resume_queue",
    "retry_failed",
    "retry_failed_many",
    "start",
    "status_counts",
    "status_of",
    "update_schedule",
    "window",
]
