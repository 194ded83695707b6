"""harvest.install(app): what it merges, what it keeps, and what it refuses (no services)."""

from __future__ import annotations

import pytest
from celery import Celery
from kombu import Exchange, Queue

from harvest import install
from harvest.broker import DISPATCH_TASK, EXECUTE_TASK
from harvest.errors import ConfigurationError
from harvest.settings import Settings

BROKER = "redis://127.0.0.1:6379/9"
SETTINGS = Settings(redis_url=BROKER)


def celery(**conf: object) -> Celery:
    app = Celery("userproj", broker=BROKER, set_as_current=False)
    app.conf.update(conf)
    return app


def test_every_other_key_is_kept_and_harvest_is_added() -> None:
    app = celery(task_serializer="json", worker_prefetch_multiplier=8, task_acks_late=False)
    before = {key: app.conf[key] for key in app.conf}
    install(app, settings=SETTINGS)
    after = {key: app.conf[key] for key in app.conf}
    assert {k for k in after if after[k] != before[k]} == {
        "task_queues",
        "task_routes",
        "beat_schedule",
        "worker_consumer",
    }
    # harvest's consumer: Celery's, surviving Celery 5.7's reconnect (harvest.worker.consumer).
    assert after["worker_consumer"] == "harvest.worker.consumer:Consumer"
    # Without queues of its own, the app's default queue stays consumed by a worker without -Q.
    assert [q.name for q in after["task_queues"]] == ["celery", "schedule", "execution"]
    assert after["task_routes"][EXECUTE_TASK] == {"queue": "execution"}
    assert set(after["beat_schedule"]) == {
        "harvest-dispatch",
        "harvest-rescue",
        "harvest-schedules",
        "harvest-maintenance",
    }
    assert {DISPATCH_TASK, EXECUTE_TASK} <= set(app.tasks)
    # Harvest's tasks keep their delivery options on the project's app.
    assert app.tasks[EXECUTE_TASK].acks_late is True
    assert app.tasks[DISPATCH_TASK].acks_late is False
    # Its plumbing stays out of Flower's task list (each job attempt is a task of its own).
    assert app.tasks[EXECUTE_TASK].send_events is False
    assert app.tasks[DISPATCH_TASK].send_events is False


def test_routes_of_every_shape_are_kept() -> None:
    def router(name: str, args: object, kwargs: object, options: object, **kw: object) -> None:
        return None

    as_list = celery(task_routes=[{"a.*": {"queue": "a"}}])
    install(as_list, settings=SETTINGS)
    assert as_list.conf.task_routes[1:] == ({"a.*": {"queue": "a"}},)
    as_function = celery(task_routes=router)
    install(as_function, settings=SETTINGS)
    assert as_function.conf.task_routes[1] is router
    as_dict = celery(task_routes={"a.*": {"queue": "a"}})
    install(as_dict, settings=SETTINGS)
    assert as_dict.conf.task_routes["a.*"] == {"queue": "a"}
    assert as_dict.conf.task_routes[DISPATCH_TASK] == {"queue": "schedule"}


def test_what_cannot_be_merged_safely_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="accepts only \\['pickle'\\]"):
        install(celery(accept_content=["pickle"]), settings=SETTINGS)
    with pytest.raises(ConfigurationError, match="HARVEST_BROKER_URL"):
        install(
            Celery("other", broker="amqp://u:pw@rabbit//", set_as_current=False),
            settings=SETTINGS,
        )
    mine = Queue("execution", Exchange("mine"), routing_key="mine")
    with pytest.raises(ConfigurationError, match="queue named 'execution'"):
        install(celery(task_queues=(mine,)), settings=SETTINGS)
    with pytest.raises(ConfigurationError, match=r"harvest\.dispatch"):
        install(celery(task_routes={DISPATCH_TASK: {"queue": "elsewhere"}}), settings=SETTINGS)
    clash = {"harvest-dispatch": {"task": "mine.tick", "schedule": 1.0}}
    with pytest.raises(ConfigurationError, match="entry 'harvest-dispatch' for another task"):
        install(celery(beat_schedule=clash), settings=SETTINGS)


def test_a_refused_install_changes_nothing() -> None:
    app = celery(accept_content=["pickle"])
    before = {key: app.conf[key] for key in app.conf}
    with pytest.raises(ConfigurationError):
        install(app, settings=SETTINGS)
    assert {key: app.conf[key] for key in app.conf} == before


def test_job_names_become_tasks_that_only_say_how_to_enqueue() -> None:
    """`celery inspect registered` lists what a worker runs; a job name sent by hand as a
    Celery task fails with a line naming the way to enqueue it; the app's own tasks stay."""
    from harvest.worker.install import register_job_names

    app = celery()

    @app.task(name="fetch_page", shared=False)
    def own() -> str:
        return "the project's own task"

    assert register_job_names(app, ["summarize", "fetch_page"]) == ["summarize"]
    assert app.tasks["fetch_page"].run() == "the project's own task"
    with pytest.raises(RuntimeError, match=r"app.enqueue\('summarize'"):
        app.tasks["summarize"].run({"x": 1})
    assert app.tasks["summarize"].send_events is False


def test_a_consumer_of_the_apps_own_stays() -> None:
    app = celery(worker_consumer="userproj.consumer:Consumer")
    install(app, settings=SETTINGS)
    assert app.conf.worker_consumer == "userproj.consumer:Consumer"
