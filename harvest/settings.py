"""harvest's configuration: one typed object, read from ``HARVEST_*`` environment variables.

Library functions never read the environment themselves; entry points (the CLI, the Celery
app, ``Harvest()``) build a :class:`Settings` once and pass it, or the engines and clients made
from it, down.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from harvest.redact import redact_url


class Settings(BaseSettings):
    """Every knob harvest has. Each field is ``HARVEST_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="HARVEST_", extra="ignore", frozen=True)

    database_url: str = Field(
        default="postgresql+psycopg://postgres@127.0.0.1:5432/harvest",
        description="SQLAlchemy URL of the Postgres database (driver psycopg 3).",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis for coordination (key pool, rate limits, locks, nudges).",
    )
    broker_url: str | None = Field(
        default=None,
        description="Celery broker. Defaults to redis_url; an amqp:// RabbitMQ URL works too.",
    )
    imports: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Modules that define jobs (comma separated in the environment).",
    )
    secret_key: SecretStr | None = Field(
        default=None, description="Master key (Fernet) that encrypts API key secrets at rest."
    )

    # Timing knobs, in seconds unless named otherwise.
    dispatch_interval: float = Field(default=1.0, gt=0, description="Beat period of dispatch.")
    rescue_interval: float = Field(default=5.0, gt=0, description="Beat period of rescue.")
    lease_ttl: float = Field(
        default=30.0, gt=0, description="A running job's lease; heartbeats extend it."
    )
    dispatch_ttl: float = Field(
        default=120.0,
        gt=0,
        description="How long a dispatched job may wait in the broker before rescue re-queues it.",
    )
    claim_batch_size: int = Field(default=200, ge=1, le=10_000)
    inflight_window: int = Field(
        default=400, ge=1, description="Most jobs dispatched or running at once."
    )
    max_jobs_per_message: int = Field(
        default=16, ge=1, le=500, description="Jobs one execution message may carry (deep queue)."
    )
    nudge_coalesce_ms: int = Field(
        default=1000,
        ge=1,
        description="At most one dispatch nudge per this many milliseconds (across processes).",
    )
    leader_ttl: float = Field(
        default=10.0, gt=0, description="Beat leadership lasts this long without renewal."
    )
    key_wait: float = Field(
        default=2.0,
        ge=0,
        description="How long a job waits for a free API key before it goes back to pending.",
    )
    default_timeout: float = Field(default=300.0, gt=0, description="A job's time limit.")
    max_timeout: float = Field(
        default=3600.0, gt=0, description="Largest time limit a job may declare."
    )
    max_payload_bytes: int = Field(default=256 * 1024, ge=1)
    retry_base: float = Field(default=1.0, ge=0, description="First retry delay.")
    retry_max: float = Field(default=600.0, ge=0, description="Longest retry delay.")
    db_pool_size: int = Field(default=2, ge=1, description="Connections per process.")
    db_max_overflow: int = Field(default=2, ge=0)
    statement_timeout_ms: int = Field(default=30_000, ge=0)
    idle_in_transaction_timeout_ms: int = Field(default=60_000, ge=0)
    worker_concurrency: int = Field(default=2, ge=1)
    task_events: bool = Field(
        default=True,
        description="Workers send Celery task events (Flower's live view). Off: Celery's "
        "default; Flower turns them on while it runs (every 5 s).",
    )
    broker_visibility_timeout: float | None = Field(
        default=None,
        gt=0,
        description="Broker redelivery timeout; default max_timeout + 2 x lease_ttl + 60 s.",
    )

    # Scheduling and flow control.
    schedules_interval: float = Field(
        default=1.0, gt=0, description="Beat period of the recurring-schedules task."
    )
    schedule_grace: float = Field(
        default=15.0,
        ge=0,
        le=86_400,
        description="A fire time later than this when its tick comes is missed (misfire policy).",
    )
    starvation_after: float = Field(
        default=300.0,
        ge=0,
        description="Due jobs waiting longer than this get an aging share of every claim "
        "(10 %, at least one), oldest first, whatever their priority. 0 turns aging off.",
    )
    max_queue_depth: int = Field(
        default=1_000_000, ge=1, description="Most pending jobs a queue may hold (backpressure)."
    )
    queue_max_depths: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="Per-queue overrides of max_queue_depth: 'queue=n,queue=n' in the environment.",
    )
    max_batch_size: int = Field(default=100_000, ge=1, description="Most jobs in one batch.")
    maintenance_interval: float = Field(
        default=60.0, gt=0, description="Beat period of retention (pruning)."
    )
    retention_seconds: float = Field(
        default=86_400.0, gt=0, description="Succeeded and cancelled jobs are pruned after this."
    )
    dead_retention_seconds: float = Field(
        default=30 * 86_400.0,
        gt=0,
        description="Failed (dead) jobs, completed batches and schedule fire records are pruned "
        "after this.",
    )
    prune_batch_size: int = Field(
        default=1000, ge=1, le=100_000, description="Rows one pruning statement deletes."
    )

    @field_validator("imports", mode="before")
    @classmethod
    def _split_imports(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("queue_max_depths", mode="before")
    @classmethod
    def _parse_depths(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        depths: dict[str, object] = {}
        for part in value.split(","):
            if not part.strip():
                continue
            queue, sep, number = part.partition("=")
            if not sep or not queue.strip():
                raise ValueError(f"queue_max_depths: expected 'queue=n', got {part.strip()!r}")
            depths[queue.strip()] = number.strip()
        return depths

    @field_validator("queue_max_depths")
    @classmethod
    def _positive_depths(cls, value: dict[str, int]) -> dict[str, int]:
        for queue, depth in value.items():
            if depth < 1:
                raise ValueError(f"queue_max_depths: {queue}={depth} must be at least 1")
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, value: str) -> str:
        if value.startswith("postgresql://"):
            value = "postgresql+psycopg://" + value.removeprefix("postgresql://")
        if not value.startswith("postgresql+psycopg://"):
            raise ValueError(
                f"database_url must be a postgresql+psycopg:// URL, got {redact_url(value)!r}"
                " (SQLite cannot do FOR UPDATE SKIP LOCKED)"
            )
        return value

    @model_validator(mode="after")
    def _timeouts_fit(self) -> Settings:
        if self.default_timeout > self.max_timeout:
            raise ValueError("default_timeout must not exceed max_timeout")
        return self

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def heartbeat_interval(self) -> float:
        """How often running jobs renew their leases: a third of the TTL."""
        return self.lease_ttl / 3

    @property
    def visibility_timeout(self) -> int:
        """Broker redelivery timeout: longer than any job may run, so no job is redelivered
        while it is still running (a redelivery would be refused by the token anyway).
        ``broker_visibility_timeout`` overrides it. Delays never depend on it: a delayed job
        stays in Postgres until due, and no message exists for it before then."""
        if self.broker_visibility_timeout is not None:
            return max(1, int(self.broker_visibility_timeout))
        return int(self.max_timeout + self.lease_ttl * 2 + 60)

    def queue_depth_limit(self, queue: str) -> int:
        """The most pending jobs ``queue`` may hold."""
        return self.queue_max_depths.get(queue, self.max_queue_depth)

    @property
    def psycopg_url(self) -> str:
        """The database URL in the form psycopg's own ``connect`` takes."""
        return "postgresql://" + self.database_url.split("://", 1)[1]


def load_settings(**overrides: object) -> Settings:
    """Settings for an entry point: the environment, then the URLs that ``harvest dev up``
    recorded (when the environment does not name them), then ``overrides``."""
    import os

    values: dict[str, object] = {}
    if not (os.environ.get("HARVEST_DATABASE_URL") and os.environ.get("HARVEST_REDIS_URL")):
        from harvest.dev import load_dev_urls, state_dir

        recorded = load_dev_urls(state_dir()) or {}
        for name in ("database_url", "redis_url"):
            if not os.environ.get(f"HARVEST_{name.upper()}") and name in recorded:
                values[name] = recorded[name]
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]
