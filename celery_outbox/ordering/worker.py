"""The worker's side of strict ordering: settle a strict head when its task ended.

A strict head stays in the outbox, running, after it was published; the next row
of its key waits for it. :mod:`celery_outbox.engine.endings` connects Celery's signals (in the pool's
child and in the worker's main process) and tells :func:`report` each way a strict
task ended; :func:`~.core.report_for` says what becomes of its row: it goes (and on
PostgreSQL the relay is woken at once), it stays held while the task runs again,
it is published again now (its worker process died), or the key's policy applies
(block it, or dead-letter the head and go on).

The reports are written by the process's reporter thread
(:mod:`celery_outbox.engine.reports`). Nothing is published on a report's strength
before it is committed, so order holds; a report still queued when its process is
killed is lost like the report of a task killed with its worker: the head is
published again once its running lease (``CELERY_OUTBOX_STRICT_LEASE_SECONDS``,
counted from the publish) is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..conf import get_settings
from ..engine import endings, reports
from ..engine.endings import TaskEnd
from ..engine.reports import REPORTER
from ..exceptions import OutboxDatabaseError
from ..ordering_options import Ordering, is_strict
from ..store import OrderingStore
from .core import Report, report_for

logger = logging.getLogger("celery_outbox.ordering")


def install() -> None:
    """Connect the reporting receivers once per process (idempotent)."""
    endings.install(report)
    reports.install()


def report(end: TaskEnd) -> None:
    """Queue the settlement of a strict head whose task ended (``end``)."""
    if not is_strict(end.headers):
        return  # a flow key's task: celery_outbox.flow.worker reports it
    try:
        write = settlement(end, Ordering.read("", end.headers))
        REPORTER.send(
            lambda stores: write(stores.ordering()), end.task_id, end.ending.value
        )
    except Exception:
        # The lease stays the safety net: the head is published again after it.
        logger.exception(
            "strict ordering: cannot report task %s (%s)", end.task_id, end.ending.value
        )


def settlement(end: TaskEnd, ordering: Ordering) -> Callable[[OrderingStore], int]:
    """The store call that settles ``end``'s row, as :func:`~.core.report_for` says."""
    task_id, row = end.task_id, ordering.row_token
    decided = report_for(end.ending)
    if decided is Report.DONE:
        return lambda store: store.task_done(task_id, row)
    if decided is Report.HELD:
        seconds = get_settings().strict_lease_seconds + end.delay
        return lambda store: store.task_retrying(task_id, seconds, row)
    if decided is Report.AGAIN:
        return lambda store: store.task_again(task_id, row)
    return lambda store: _failed(store, end, ordering)


def _failed(store: OrderingStore, end: TaskEnd, ordering: Ordering) -> int:
    """Apply the key's policy; a report refused once is sent again without its text.

    The store makes the text storable; should the report fail all the same, the
    second one (on a new connection) records the failure's kind and why its text
    could not be recorded, so that the key's policy still applies and the attempt
    counts, instead of the task running again after every lease.
    """
    try:
        return store.task_failed(
            end.task_id, end.error, ordering.policy, ordering.row_token
        )
    except OutboxDatabaseError as refused:
        store.reset_connection()
        note = f"{end.kind or 'failure'} (its text could not be recorded: {refused})"
        return store.task_failed(end.task_id, note, ordering.policy, ordering.row_token)
