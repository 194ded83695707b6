"""SQLAlchemy 2 typed models. The schema itself is made by Alembic (alembic/versions)."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class JobStatus(enum.StrEnum):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
IN_FLIGHT = ("dispatched", "running")


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    """One job. ``status`` is text checked by a constraint (an enum type would make every new
    state a blocking ``ALTER TYPE``)."""

    __tablename__ = "harvest_jobs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    queue: Mapped[str] = mapped_column(Text, server_default="execution")
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    status: Mapped[str] = mapped_column(Text, server_default="pending")
    priority: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    max_attempts: Mapped[int] = mapped_column(Integer, server_default="3")
    timeout: Mapped[float | None] = mapped_column(Float, nullable=True)
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    idempotency_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    pool: Mapped[str | None] = mapped_column(Text, nullable=True)  # API key pool that gates it
    result: Mapped[Any | None] = mapped_column(JSONB, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_traceback: Mapped[str | None] = mapped_column(Text, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(server_default=text("false"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    batch_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # harvest_batches.id
    worker: Mapped[str | None] = mapped_column(Text, nullable=True)  # hostname:pid of the attempt
    # When a run of deferrals (no key free, unknown job name, shutdown) began; cleared at start.
    deferred_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Fairness key (migration 0011): dispatch shares each claim across tenants; NULL is one.
    tenant: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'dispatched', 'running', 'succeeded', 'failed', 'cancelled')",
            name="harvest_jobs_status_check",
        ),
        CheckConstraint("max_attempts >= 1", name="harvest_jobs_max_attempts_check"),
        Index(
            "harvest_jobs_claim_idx",
            text("priority DESC"),
            "run_at",
            "id",
            postgresql_where=text("status = 'pending'"),
        ),
        Index(
            "harvest_jobs_lease_idx",
            "lease_expires_at",
            postgresql_where=text("status IN ('dispatched', 'running')"),
        ),
        Index(
            "harvest_jobs_idempotency_key_idx",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        Index("harvest_jobs_batch_idx", "batch_id", postgresql_where=text("batch_id IS NOT NULL")),
        # The aging share of the claim (starvation bound): oldest due pending jobs first.
        Index("harvest_jobs_age_idx", "run_at", "id", postgresql_where=text("status = 'pending'")),
        # Queue depth for backpressure.
        Index(
            "harvest_jobs_pending_queue_idx", "queue", postgresql_where=text("status = 'pending'")
        ),
        # A job name's depth (its max_depth); written only for pending rows, so a job's claim,
        # start and end write no entry here (migration 0014).
        Index("harvest_jobs_pending_name_idx", "name", postgresql_where=text("status = 'pending'")),
        # Search by a payload path (containment, harvest.search); migration 0010.
        Index(
            "harvest_jobs_payload_idx",
            "payload",
            postgresql_using="gin",
            postgresql_ops={"payload": "jsonb_path_ops"},
        ),
        # The fair claim: each tenant's due jobs in claim order (NULL tenant as ''); 0011.
        Index(
            "harvest_jobs_tenant_claim_idx",
            text("(COALESCE(tenant, ''))"),
            text("priority DESC"),
            "run_at",
            "id",
            postgresql_where=text("status = 'pending'"),
        ),
        # Retention finds the oldest finished jobs without a scan.
        Index(
            "harvest_jobs_finished_idx",
            "finished_at",
            postgresql_where=text("status IN ('succeeded', 'failed', 'cancelled')"),
        ),
    )


class AttemptRow(Base):
    """One ended attempt of a job (written by a trigger when the job leaves ``running``; the
    last 20 of each job are kept, and go with the job). See migration 0007."""

    __tablename__ = "harvest_job_attempts"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    job_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("harvest_jobs.id", ondelete="CASCADE")
    )
    attempt: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    outcome: Mapped[str] = mapped_column(Text)  # succeeded, retry, failed, cancelled
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("harvest_job_attempts_job_idx", "job_id", "attempt"),)


class QueuePauseRow(Base):
    """A paused queue: dispatch claims none of its jobs until the row is deleted (resume).
    See migration 0009 and :mod:`harvest.queues`."""

    __tablename__ = "harvest_queue_pauses"

    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    paused_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class CounterRow(Base):
    """Monotonic event counters that must survive restarts and agree across processes
    (duplicate deliveries suppressed, lost leases, rescues)."""

    __tablename__ = "harvest_counters"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, server_default="0")


class ApiKeyRow(Base):
    """One API key of a named pool. The secret is stored only as a Fernet token
    (``secret_encrypted``); ``secret_hint`` (``sk-…abcd``) is the only form ever shown.
    ``status`` is text checked by a constraint, like the jobs' status."""

    __tablename__ = "harvest_api_keys"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    pool: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)
    secret_encrypted: Mapped[bytes] = mapped_column(LargeBinary)
    secret_hint: Mapped[str] = mapped_column(Text)
    max_concurrency: Mapped[int] = mapped_column(Integer, server_default="1")
    rate_limit: Mapped[str | None] = mapped_column(Text, nullable=True)
    tpm: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # tokens/minute; None: none
    status: Mapped[str] = mapped_column(Text, server_default="active")
    cooldown_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (
        UniqueConstraint("pool", "name", name="harvest_api_keys_pool_name_key"),
        CheckConstraint("max_concurrency >= 1", name="harvest_api_keys_max_concurrency_check"),
        CheckConstraint("tpm >= 1", name="harvest_api_keys_tpm_check"),
        CheckConstraint(
            "status IN ('active', 'cooling', 'disabled')", name="harvest_api_keys_status_check"
        ),
    )


class ScheduleRow(Base):
    """A recurring schedule: a job enqueued at every fire time of a cron expression (in its
    timezone) or of a fixed interval. ``next_run_at`` is always a fire time."""

    __tablename__ = "harvest_schedules"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    job_name: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    cron: Mapped[str | None] = mapped_column(Text, nullable=True)
    every_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    timezone: Mapped[str] = mapped_column(Text, server_default="UTC")
    enabled: Mapped[bool] = mapped_column(server_default=text("true"))
    misfire: Mapped[str] = mapped_column(Text, server_default="run_once")
    catch_up: Mapped[int] = mapped_column(Integer, server_default="1")
    priority: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    next_run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_fired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (
        UniqueConstraint("name", name="harvest_schedules_name_key"),
        CheckConstraint(
            "(cron IS NULL) <> (every_seconds IS NULL)", name="harvest_schedules_timing_check"
        ),
        CheckConstraint(
            "every_seconds IS NULL OR every_seconds > 0", name="harvest_schedules_every_check"
        ),
        CheckConstraint(
            "misfire IN ('skip', 'run_once', 'catch_up')", name="harvest_schedules_misfire_check"
        ),
        CheckConstraint("catch_up >= 1", name="harvest_schedules_catch_up_check"),
        Index("harvest_schedules_due_idx", "next_run_at", postgresql_where=text("enabled")),
    )


class ScheduleFireRow(Base):
    """One fire time of one schedule, and the job it enqueued: the primary key makes it one
    job per (schedule, fire time), however many schedule workers and beats run."""

    __tablename__ = "harvest_schedule_fires"

    schedule_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("harvest_schedules.id", ondelete="CASCADE"), primary_key=True
    )
    fire_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    job_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (Index("harvest_schedule_fires_fire_at_idx", "fire_at"),)


class BatchRow(Base):
    """A batch of jobs (the distributed barrier). Its counters are kept by the trigger
    ``harvest_jobs_batch_member`` (alembic 0004), which inserts the callback job exactly once
    when the last member ends."""

    __tablename__ = "harvest_batches"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    total: Mapped[int] = mapped_column(Integer)
    succeeded: Mapped[int] = mapped_column(Integer, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, server_default="0")
    cancelled: Mapped[int] = mapped_column(Integer, server_default="0")
    callback_name: Mapped[str | None] = mapped_column(Text, nullable=True)
    callback_queue: Mapped[str | None] = mapped_column(Text, nullable=True)
    callback_payload: Mapped[dict[str, Any]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb")
    )
    callback_priority: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    callback_max_attempts: Mapped[int] = mapped_column(Integer, server_default="3")
    callback_timeout: Mapped[float | None] = mapped_column(Float, nullable=True)
    callback_pool: Mapped[str | None] = mapped_column(Text, nullable=True)
    callback_job_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        CheckConstraint("total >= 1", name="harvest_batches_total_check"),
        Index(
            "harvest_batches_completed_idx",
            "completed_at",
            postgresql_where=text("completed_at IS NOT NULL"),
        ),
    )


class _UsageCounts:
    """The columns both usage tables share: the jobs' tenant ('' for none, in the key) and the
    four counts."""

    tenant: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    requests: Mapped[int] = mapped_column(BigInteger, server_default="0")
    tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    rate_limited: Mapped[int] = mapped_column(BigInteger, server_default="0")
    errors: Mapped[int] = mapped_column(BigInteger, server_default="0")


class KeyUsageRow(_UsageCounts, Base):
    """Calls made with one key in one minute (migration 0012, :mod:`harvest.usage`): added to
    by each worker's flush, pruned by retention. ``tenant`` '' means none."""

    __tablename__ = "harvest_key_usage"

    minute: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    pool: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class KeyUsageTotalRow(_UsageCounts, Base):
    """Calls made with one key since it was first used: only grows (the metrics' counters)."""

    __tablename__ = "harvest_key_usage_totals"

    pool: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
