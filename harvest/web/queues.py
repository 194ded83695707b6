"""The Queues page and its API: each queue's pending and running jobs, and pausing and resuming
dispatch of a queue (:mod:`harvest.queues`), with the CSRF check every POST gets.

Pages post the queue as a form field (a queue name may hold ``/``); the API takes it in the
path (``/api/queues/{queue}/pause``). A malformed name is refused (422), an unknown one is 404.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import AfterValidator

from harvest.app import Harvest
from harvest.queues import Queue
from harvest.validation import MAX_QUEUE, NAME_PATTERN, check_queue
from harvest.web import pages
from harvest.web.api import ERRORS, POST_ERRORS
from harvest.web.models import Out

QueueParam = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_QUEUE,
        pattern=NAME_PATTERN,
        description="The queue's name: not only whitespace, no control character.",
    ),
    AfterValidator(check_queue),
]

# The fixed messages of the page's actions (chosen by the ``done`` code of the redirect).
pages.MESSAGES.update(
    queue_paused="Queue paused: dispatch claims none of its jobs until it is resumed.",
    queue_resumed="Queue resumed: its due jobs are dispatched again.",
)

QUEUE_POST_ERRORS = {**POST_ERRORS, 422: {"description": "Not a usable queue name."}}

router = APIRouter(include_in_schema=False)
api_router = APIRouter(prefix="/api", responses={401: ERRORS[401], 503: ERRORS[503]})


def _app(request: Request) -> Harvest:
    harvest: Harvest = request.app.state.harvest
    return harvest


# --- pages ----------------------------------------------------------------------------------


@router.get("/queues", response_class=HTMLResponse)
def queues_page(request: Request) -> HTMLResponse:
    return pages.render(request, "queues.html", queues=_app(request).list_queues())


@router.post("/queues/pause")
async def queue_pause(request: Request) -> RedirectResponse:
    name = check_queue((await pages.form(request)).get("queue"))
    await pages._threaded(_app(request).pause_queue, name)
    return pages.back("/queues", done="queue_paused")


@router.post("/queues/resume")
async def queue_resume(request: Request) -> RedirectResponse:
    name = check_queue((await pages.form(request)).get("queue"))
    await pages._threaded(_app(request).resume_queue, name)
    return pages.back("/queues", done="queue_resumed")


# --- API ------------------------------------------------------------------------------------


class QueueOut(Out):
    name: str
    pending: int
    ready: int
    running: int
    paused: bool
    paused_at: datetime | None

    @classmethod
    def of(cls, q: Queue) -> QueueOut:
        return cls(name=q.name, pending=q.pending, ready=q.ready, running=q.running,
                   paused=q.paused, paused_at=q.paused_at)  # fmt: skip


class QueueChangeOut(QueueOut):
    changed: bool


@api_router.get("/queues", summary="Queues: pending, due and running jobs; paused or not")
def queues(request: Request) -> list[QueueOut]:
    return [QueueOut.of(q) for q in _app(request).list_queues()]


@api_router.post("/queues/{queue:path}/pause", summary="Pause dispatch of a queue",
                 responses=QUEUE_POST_ERRORS)  # fmt: skip
def pause_queue(request: Request, queue: QueueParam) -> QueueChangeOut:
    done = _app(request).pause_queue(queue)
    return QueueChangeOut(**QueueOut.of(done.queue).model_dump(), changed=done.changed)


@api_router.post("/queues/{queue:path}/resume", summary="Resume dispatch of a queue",
                 responses=QUEUE_POST_ERRORS)  # fmt: skip
def resume_queue(request: Request, queue: QueueParam) -> QueueChangeOut:
    done = _app(request).resume_queue(queue)
    return QueueChangeOut(**QueueOut.of(done.queue).model_dump(), changed=done.changed)
