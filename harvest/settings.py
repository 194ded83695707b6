"""harvest's configuration: one typed object, read from ``HARVEST_*`` environment variables.

Library functions never read the environment themselves; entry points (the CLI, the Celery
app, ``Harvest()``) build a :class:`Settings` once and pass it, or the engines and clients made
from it, down.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from harvest.errors import ConfigurationError

MAX_TENANT_WEIGHT = 1000  # a tenant's jobs per round of the fair claim, at most


class Settings(BaseSettings):
    """Every knob harvest has. Each field is ``HARVEST_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="HARVEST_", extra="ignore", frozen=True)

    database_url: str = Field(
        default="postgresql+psycopg://postgres@127.0.0.1:5432/harvest",
        description="SQLAlchemy URL of the Postgres database (driver psycopg 3).",
    )
    database_pooler: Literal["none", "transaction"] = Field(
        default="none",
        description="What sits between harvest and Postgres: none (a direct connection), or "
        "transaction (PgBouncer or another pooler in transaction mode): harvest then prepares "
        "no statement and sends no startup options (statement timeouts come from the role).",
    )
    database_direct_url: str | None = Field(
        default=None,
        description="Postgres itself, bypassing the pooler, for migrations (harvest migrate). "
        "Default: database_url.",
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
    inflight_window: int | None = Field(
        default=None,
        ge=1,
        description="Most jobs dispatched or running at once. Default: what the live execution "
        "processes can run at once plus one claim batch (at least 400).",
    )
    max_jobs_per_message: int = Field(
        default=16,
        ge=1,
        le=500,
        description="Jobs one execution message may carry (deep queue); an async job's "
        "messages carry up to 8 times this (they run at once, as the loop has room).",
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
    task_events: bool | None = Field(
        default=None,
        description="Job attempts as Celery task events (Flower's live view). Unset: as "
        "Celery sends task events, while the worker runs with -E or after enable_events "
        "(Flower sends it), until disable_events. true: always. false: never.",
    )
    tick_events: bool = Field(
        default=False,
        description="Celery task events for harvest's own tasks too (dispatch, rescue, "
        "schedules and maintenance ticks, execution messages). Off: Flower's task list shows "
        "jobs only, one task per attempt.",
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
    tenant_weights: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="Fair share: a tenant's jobs per round of the claim's round-robin (1 to "
        "1000; a tenant not named has 1): 'tenant=n,tenant=n' in the environment.",
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
    usage_retention_seconds: float = Field(
        default=30 * 86_400.0,
        gt=0,
        description="Usage per key and minute (harvest.usage) is pruned after this.",
    )
    usage_flush_interval: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Seconds between an execution process's writes of its usage counts: a "
        "process that dies loses at most this window of usage (never jobs).",
    )
    prune_batch_size: int = Field(
        default=1000, ge=1, le=100_000, description="Rows one pruning statement deletes."
    )
    history_after: float = Field(
        default=300.0,
        ge=0,
        description="Finished jobs move from harvest_jobs to the partitioned history this many "
        "seconds after they end (by maintenance; a kind whose retention is under a day stays).",
    )
    history_batch_size: int = Field(
        default=5000, ge=1, le=100_000, description="Jobs one move to the history takes."
    )

    # Concurrent execution: async handlers on each process's event loop, thread pools.
    async_concurrency: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="Async jobs one execution process runs at once on its event loop "
        "(celery worker --async-concurrency N says the same).",
    )
    write_linger_ms: float = Field(
        default=2.0,
        ge=0,
        le=1000,
        description="How long an execution process gathers the holds and starts of its async "
        "jobs (and of its sync jobs on -P threads or -P gevent) before writing each kind as one "
        "statement (one commit). A job that holds its key writes its start before its call: "
        "this is time a key may wait. On prefork (and -P solo), also the most run time a window "
        "of a message's short sync jobs may add up to for them to start in one statement.",
    )
    settle_linger_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="The most an execution process lets the finish of an async job (or of a "
        "sync job on -P threads or -P gevent) wait to "
        "share a statement with others: a fiftieth of the handler's run time, at least "
        "HARVEST_WRITE_LINGER_MS and at most this (deferrals: this). No key waits on them; a job "
        "that ran for seconds is recorded milliseconds later.",
    )
    async_db_pool_size: int = Field(
        default=4, ge=1, le=1000, description="Postgres connections of one process's event loop."
    )
    shutdown_grace: float = Field(
        default=30.0,
        ge=0,
        description="Warm shutdown: how long async jobs in flight may run on before they are "
        "handed back (pending again at once, the attempt not counted).",
    )
    unknown_job_grace: float = Field(
        default=300.0,
        ge=0,
        description="A job whose name the worker does not know (a rolling deploy) is deferred "
        "without using an attempt for this long, then failed.",
    )

    # harvest in a project (issue 14).
    log_format: Literal["logfmt", "json"] = Field(
        default="logfmt",
        description="Job-level log lines (one per attempt at start and end): logfmt through "
        "the worker's log, or json (one object a line, on the worker's stderr).",
    )
    job_log: Literal["all", "ends", "problems", "off"] = Field(
        default="all",
        description="Which job-level log lines a worker writes: all (an attempt's start and "
        "end), ends (its end only), problems (the end of an attempt that did not succeed: a "
        "retry, a failure, a cancel, a dropped outcome), off (none).",
    )

    @field_validator("imports", mode="before")
    @classmethod
    def _split_imports(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("queue_max_depths", "tenant_weights", mode="before")
    @classmethod
    def _parse_pairs(cls, value: object, info: ValidationInfo) -> object:
        """'name=n,name=n' from the environment, as a mapping."""
        if not isinstance(value, str):
            return value
        pairs: dict[str, object] = {}
        for part in value.split(","):
            if not part.strip():
                continue
            name, sep, number = part.partition("=")
            if not sep or not name.strip():
                what = "queue" if info.field_name == "queue_max_depths" else "tenant"
                raise ValueError(f"{info.field_name}: expected '{what}=n', got {part.strip()!r}")
            pairs[name.strip()] = number.strip()
        return pairs

    @field_validator("queue_max_depths")
    @classmethod
    def _positive_depths(cls, value: dict[str, int]) -> dict[str, int]:
        for queue, depth in value.items():
            if depth < 1:
                raise ValueError(f"queue_max_depths: {queue}={depth} must be at least 1")
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _weights_in_range(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, weight in value.items():
            if not 1 <= weight <= MAX_TENANT_WEIGHT:
                raise ValueError(
                    f"tenant_weights: {tenant}={weight} must be from 1 to {MAX_TENANT_WEIGHT}"
                )
        return value

    @field_validator("database_url", "database_direct_url")
    @classmethod
    def _postgres_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if value.startswith("postgresql://"):
            value = "postgresql+psycopg://" + value.removeprefix("postgresql://")
        if not value.startswith("postgresql+psycopg://"):
            # Never the URL itself: a value not in scheme://user:pass@host form is not masked
            # reliably (its password could be anywhere in it).
            scheme = value.partition(":")[0] if "://" in value else ""
            got = (
                f"a {scheme}:// URL"
                if scheme.replace("+", "").isalnum()
                else "a value that is not a URL"
            )
            why = " (SQLite cannot do FOR UPDATE SKIP LOCKED)" if "sqlite" in scheme else ""
            raise ValueError(
                f"{info.field_name} must be a postgresql:// (postgresql+psycopg://) URL, "
                f"got {got}{why}"
            )
        return _check_url(value, str(info.field_name))

    @field_validator("redis_url", "broker_url")
    @classmethod
    def _parseable(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _check_url(value, str(info.field_name)) if value is not None else None

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

    @property
    def pooled(self) -> bool:
        """True when connections go through a transaction-mode pooler (PgBouncer): nothing may
        outlive a transaction on a server connection."""
        return self.database_pooler == "transaction"

    def migration_settings(self) -> Settings:
        """These settings as migrations see them: ``database_direct_url`` when set (then no
        pooler in between), else the same connection as every other role."""
        if self.database_direct_url is None:
            return self
        return self.model_copy(
            update={
                "database_url": self.database_direct_url,
                "database_direct_url": None,
                "database_pooler": "none",
            }
        )


def _check_url(value: str, name: str) -> str:
    """A URL a driver can parse (its port a number); the error never holds the URL."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        raise ValueError(f"{name}: the port is not a number from 0 to 65535") from None
    if not parts.scheme or (not parts.netloc and not parts.path):
        raise ValueError(f"{name} must be a URL (scheme://user:password@host:port/...)")
    return value


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
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigurationError(explain_invalid(exc)) from None


def explain_invalid(exc: ValidationError) -> str:
    """Which variables are wrong and why, on one line; never their values (one may be a
    secret)."""
    problems = "; ".join(
        f"HARVEST_{str(e['loc'][0]).upper() if e['loc'] else exc.title}: "
        f"{str(e['msg']).removeprefix('Value error, ')}"
        for e in exc.errors(include_input=False, include_url=False)
    )
    return f"bad configuration: {problems}"
