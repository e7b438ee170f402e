"""The worker's side of a flow's limits per key: a key's slot, started and freed.

The gate takes a slot of a task's flow key when it lets the task go
(:meth:`~celery_outbox.store.protocol.FlowStore.decide`). The worker that runs the
task tells the outbox when it starts (its slot is no longer ``queued``) and when
it ends, however it ends (:mod:`celery_outbox.engine.endings`, the same signals
strict ordering hears): its slot frees, and a row of the key that waited for one
is due at once; a run that puts its task back in the broker (``Reject(requeue=True)``)
keeps the slot, queued again, for the run to come. The reports go through the process's reporter thread
(:mod:`celery_outbox.engine.reports`), which writes each until it is written; a
report that is lost (its worker was killed) leaves the slot taken until the
flow's ``lease`` is over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery.signals import task_prerun

from ..conf import get_settings
from ..engine import endings, reports
from ..engine.endings import TaskEnd, watched_headers
from ..engine.reports import REPORTER, Write
from ..ordering.core import Ending
from .core import FLOW_HEADER, KEY_HEADER, Flow

logger = logging.getLogger("celery_outbox.flow")


def install() -> None:
    """Connect the reporting receivers once per process (idempotent)."""
    endings.install(report_end)
    reports.install()
    task_prerun.connect(_started, weak=False, dispatch_uid="celery_outbox.flow.start")


def keyed(headers: Mapping[str, Any] | None) -> tuple[Flow, str] | None:
    """The flow (of the settings) and the key a delivered task's headers name, when
    the flow has limits per key; else None."""
    if not headers:
        return None
    name, key = headers.get(FLOW_HEADER), headers.get(KEY_HEADER)
    if not isinstance(name, str) or not isinstance(key, str):
        return None
    flow = next((f for f in get_settings().flows if f.name == name), None)
    if flow is None or not flow.limits:
        return None
    return flow, key


def report_end(end: TaskEnd) -> None:
    """Queue the report of a flow key's task's run that ended (``end``): its slot
    frees, or is queued again when the run put its task back in the broker."""
    try:
        found = keyed(end.headers)
        if found is None:
            return
        flow, key = found
        task_id = end.task_id
        REPORTER.send(
            _end_written(end.ending, flow, key, task_id),
            task_id,
            end.ending.value,
            slot=("flow-end", flow.name, task_id),
        )
    except Exception:
        logger.exception("flow: cannot report the end of task %s", end.task_id)


def _end_written(ending: Ending, flow: Flow, key: str, task_id: str) -> Write:
    """What a run's end writes: a requeued task (back in the broker, to run again:
    published and not finished) keeps its slot, queued again; any other ending
    frees it."""
    if ending is Ending.REQUEUED:
        return lambda stores: stores.flows().task_requeued(flow, key, task_id)
    return lambda stores: stores.flows().task_ended(flow, key, task_id)


def _started(task: Any = None, task_id: str = "", **_: Any) -> None:
    try:
        found = keyed(watched_headers(getattr(task, "request", None)))
        if found is None:
            return
        flow, key = found
        started = str(task_id)
        REPORTER.send(
            lambda stores: stores.flows().task_started(flow, key, started),
            started,
            "started",
            slot=("flow-start", flow.name, started),
        )
    except Exception:
        logger.exception("flow: cannot report the start of task %s", task_id)
