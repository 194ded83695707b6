"""The worker process's Harvest object: built once per process from the environment, rebuilt
in each forked child (connections are never shared across a fork)."""

from __future__ import annotations

import os

from harvest.app import Harvest
from harvest.runner import Runner
from harvest.settings import load_settings

_state: dict[str, object] = {}


def harvest() -> Harvest:
    app = _state.get("harvest")
    if not isinstance(app, Harvest) or _state.get("pid") != os.getpid():
        app = Harvest(load_settings())
        app.load_imports()
        _state.clear()
        _state.update(harvest=app, pid=os.getpid())
    return app


def runner() -> Runner:
    harvest()  # resets state after a fork
    current = _state.get("runner")
    if not isinstance(current, Runner):
        current = Runner(harvest())
        _state["runner"] = current
    return current
