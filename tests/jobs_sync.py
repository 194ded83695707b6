"""Only the sync jobs of tests.jobs, for a ``-P gevent`` worker (which refuses async jobs)."""

from __future__ import annotations

from harvest import Harvest
from tests import jobs

app = Harvest()
app.jobs.update({name: spec for name, spec in jobs.app.jobs.items() if not spec.is_async})
