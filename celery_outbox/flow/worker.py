"""The worker's side of a flow's limits per key: a key's slot, started and freed.

The gate takes a slot of a task's flow key when it lets the task go
(:meth:`~celery_outbox.store.protocol.FlowStore.decide`). The worker that runs the
task tells the outbox when it starts (its slot is no longer ``queued``) and when
it ends, however it ends (:mod:`celery_outbox.engine.endings`, the same signals
strict ordering hears): its slot frees, and a row of the key that waited for one
is due at once; a run that puts its task back in the broker
(``Reject(requeue=True)``) keeps the slot, queued again, for the run to come. The
reports go through the process's reporter thread (:mod:`celery_outbox.engine.reports`),
which writes each until it is written; a report that is lost (its worker was
killed) leaves the slot taken until the flow's ``lease`` is over.

A worker that cannot report (its app is not an ``OutboxCelery``, so these
receivers are not connected, or its settings lack the flow) holds each slot for
the lease. :func:`watch`, connected by the Django app in every process, says so
once per process, at the first task it runs whose message names a flow's slot.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.signals import task_prerun

from ..conf import get_settings
from ..engine import endings, reports
from ..engine.endings import Ending, TaskEnd, watched_headers
from ..engine.reports import REPORTER, Write
from ..flow_limits import FLOW_HEADER, KEY_HEADER, Flow

logger = logging.getLogger("celery_outbox.flow")


def install() -> None:
    """Connect the reporting receivers once per process (idempotent)."""
    endings.install(report_end)
    reports.install()
    task_prerun.connect(_started, weak=False, dispatch_uid="celery_outbox.flow.start")
    CHECK.connected = True


@dataclass
class ReportingCheck:
    """Warns, once per process, when it runs a task that took a flow key's slot and
    cannot report it: its slot stays taken until the flow's lease."""

    #: Whether this process's reporting receivers are connected (:func:`install`).
    connected: bool = False
    #: The process that warned already (a forked child warns for itself).
    warned_in: int | None = None

    def __call__(self, task: Any = None, **_: Any) -> None:
        """``task_prerun``'s receiver."""
        try:
            problem = unreported(
                watched_headers(getattr(task, "request", None)), self.connected
            )
            if problem is None or self.warned_in == os.getpid():
                return
            self.warned_in = os.getpid()
            logger.warning("%s", problem)
        except Exception:
            logger.exception("flow: cannot check that this worker reports its tasks")


#: This process's check.
CHECK = ReportingCheck()


def watch() -> None:
    """Connect :data:`CHECK` (idempotent): in every process that loads Django, so
    that it runs where the reporting receivers are not connected."""
    task_prerun.connect(CHECK, weak=False, dispatch_uid="celery_outbox.flow.check")


def unreported(headers: Mapping[str, Any] | None, connected: bool) -> str | None:
    """What keeps a worker from reporting the task whose message has ``headers``,
    when they name a flow key's slot (the relay took one); None when it reports,
    or the message took no slot."""
    name, key = (headers or {}).get(FLOW_HEADER), (headers or {}).get(KEY_HEADER)
    if not name or not key:
        return None
    if not connected:
        return (
            f"this worker runs tasks of flow {name!r} (key {key!r}) and cannot report "
            f"their starts and ends: its Celery app is not an OutboxCelery, so each "
            f"task's slot stays taken until the flow's lease (the key's next task "
            f"waits for it). Create the app the worker runs (celery -A) with "
            f"celery_outbox.OutboxCelery(...) and set CELERY_OUTBOX_APP to it."
        )
    if keyed(headers) is None:
        return (
            f"this worker runs tasks of flow {name!r} (key {key!r}) and cannot report "
            f"their starts and ends: its CELERY_OUTBOX_FLOWS has no flow {name!r} "
            f"with limits per key, so each task's slot stays taken until the flow's "
            f"lease. Give the worker the relays' CELERY_OUTBOX_FLOWS."
        )
    return None


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
