"""harvest: durable jobs on Celery workers through a pool of rate-limited API keys.

The names below are imported on first use (PEP 562), so ``import harvest`` and the CLI's
``--help`` stay quick: the engine, Celery and the job registry load only when something needs
them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harvest.app import Harvest, JobSpec
    from harvest.context import JobContext
    from harvest.errors import (
        ConfigurationError,
        EnqueueError,
        HarvestError,
        InvalidJobId,
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
    from harvest.typed import JobFunction
    from harvest.worker.install import install

__all__ = [
    "ConfigurationError",
    "EnqueueError",
    "Harvest",
    "HarvestError",
    "InvalidJobId",
    "InvalidOption",
    "InvalidPayload",
    "Job",
    "JobContext",
    "JobFunction",
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
    "install",
]

_WHERE = {
    "Harvest": "harvest.app",
    "JobSpec": "harvest.app",
    "JobContext": "harvest.context",
    "Job": "harvest.jobs",
    "JobRef": "harvest.jobs",
    "JobFunction": "harvest.typed",
    "JobStatus": "harvest.models",
    "RetryPolicy": "harvest.retry",
    "Settings": "harvest.settings",
    "install": "harvest.worker.install",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name, "harvest.errors" if name in __all__ else None)
    if module is None:
        raise AttributeError(f"module 'harvest' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
