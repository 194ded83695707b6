"""harvest: durable jobs on Celery workers through a pool of rate-limited API keys."""

from harvest.app import Harvest, JobSpec
from harvest.context import JobContext
from harvest.errors import (
    EnqueueError,
    HarvestError,
    InvalidOption,
    InvalidPayload,
    JobNotFound,
    KeyRejected,
    PayloadTooLarge,
    PermanentError,
    QueueFull,
    RateLimited,
    Retry,
    UnknownJob,
    WaitTimeout,
)
from harvest.jobs import Job, JobRef
from harvest.models import JobStatus
from harvest.retry import RetryPolicy
from harvest.settings import Settings

__all__ = [
    "EnqueueError",
    "Harvest",
    "HarvestError",
    "InvalidOption",
    "InvalidPayload",
    "Job",
    "JobContext",
    "JobNotFound",
    "JobRef",
    "JobSpec",
    "JobStatus",
    "KeyRejected",
    "PayloadTooLarge",
    "PermanentError",
    "QueueFull",
    "RateLimited",
    "Retry",
    "RetryPolicy",
    "Settings",
    "UnknownJob",
    "WaitTimeout",
]
