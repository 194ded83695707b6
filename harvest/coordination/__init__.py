"""Short-lived coordination through Redis: key pool leases, rate limits, semaphores, locks.

Every read-modify-write is one Lua script (``lua/*.lua``) judged by the Redis clock; every key
name is built in :mod:`harvest.coordination.keys`.
"""

from harvest.coordination.key_pool import Busy, KeyPool, KeySpec, KeyState, Lease
from harvest.coordination.lock import LeaderElector, Leadership, Lock
from harvest.coordination.rate_limit import Rate, RateLimiter, parse_rate
from harvest.coordination.semaphore import Semaphore
from harvest.errors import LockNotAcquired, SemaphoreBusy

__all__ = [
    "Busy",
    "KeyPool",
    "KeySpec",
    "KeyState",
    "LeaderElector",
    "Leadership",
    "Lease",
    "Lock",
    "LockNotAcquired",
    "Rate",
    "RateLimiter",
    "Semaphore",
    "SemaphoreBusy",
    "parse_rate",
]
