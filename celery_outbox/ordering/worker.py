"""The worker's side of strict ordering: settle a strict head when its task ended.

A strict head stays in the outbox, running, after it was published; the next row
of its key waits for it. :mod:`.endings` connects Celery's signals (in the pool's
child and in the worker's main process) and tells :func:`report` each way a strict
task ended; :func:`~.core.report_for` says what becomes of its row: it goes (and on
PostgreSQL the relay is woken at once), it stays held while the task runs again,
it is published again now (its worker process died), or the key's policy applies
(block it, or dead-letter the head and go on).

The reports are written by a thread of the process that heard of the ending
(:class:`Reporter`), on a database connection of that thread: the task's process
goes on to its next task at once, and Celery's Django fix-up, which closes the task
thread's connections before and after every task, leaves the reporter's open.
Before, each report opened a connection and waited for its commit, which cost a
strict task more than its body. Nothing is published on a report's strength before
it is committed, so order holds; a report still queued when its process is killed
is lost like the report of a task killed with its worker: the head is published
again once its running lease (``CELERY_OUTBOX_STRICT_LEASE_SECONDS``, counted from
the publish) is over.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from celery.signals import worker_process_shutdown, worker_shutdown
from django.db import connections

from ..conf import get_settings
from ..exceptions import OutboxDatabaseError
from ..store import OrderingStore, Stores, outbox_alias
from . import endings
from .core import Report, report_for
from .endings import TaskEnd
from .options import Ordering

logger = logging.getLogger("celery_outbox.ordering")

#: How long a worker process, as it ends, waits for its reports to be written.
SHUTDOWN_SECONDS = 10.0


def install() -> None:
    """Connect the reporting receivers once per process (idempotent)."""
    endings.install(report)
    # A prefork pool's process sends the first, the worker (solo, threads, and the
    # prefork pool's main process, which reports revokes and time limits) the second.
    for ending in (worker_process_shutdown, worker_shutdown):
        ending.connect(
            _stop_reporter, weak=False, dispatch_uid="celery_outbox.strict.stop"
        )


def wait_for_reports(timeout: float = SHUTDOWN_SECONDS) -> bool:
    """Block until this process's reports so far are written; False on timeout."""
    return REPORTER.wait(timeout)


def report(end: TaskEnd) -> None:
    """Queue the settlement of a strict head whose task ended (``end``)."""
    try:
        write = settlement(end, Ordering.read("", end.headers))
        REPORTER.send(write, end.task_id, end.ending.value)
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


# -- the reporter thread -----------------------------------------------------------

#: One report: what it writes, on which alias, and the task id and state it is for.
_Report = tuple[Callable[[OrderingStore], int], str, str, str]
#: What the reporter's queue carries: a report, a marker to set once every report
#: before it is written, or None to end the thread.
_Item = _Report | threading.Event | None


class Reporter:
    """Writes one process's strict reports, in order, from a thread of its own.

    Started by the first report of a process (again after a fork: a thread does
    not survive one). A report that fails is sent once more on a new connection
    (the kept one may have gone with a database restart; the statements are
    idempotent), then logged: the lease stays the safety net.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Item] | None = None
        self._pid = 0

    def send(
        self, write: Callable[[OrderingStore], int], task_id: str, state: str
    ) -> None:
        """Queue one report; it is written after those queued before it.

        The outbox alias is resolved here, in the task's thread (a router may
        depend on that thread's state), and the report written on it.
        """
        alias = outbox_alias(get_settings())
        self._running().put((write, alias, task_id, state))

    def wait(self, timeout: float) -> bool:
        """Until the reports queued so far are written (True), or ``timeout`` passed."""
        with self._lock:
            found = self._queue if self._pid == os.getpid() else None
        if found is None:
            return True
        written = threading.Event()
        found.put(written)
        return written.wait(timeout)

    def stop(self, timeout: float) -> bool:
        """Write what is queued (up to ``timeout``), then end the thread."""
        written = self.wait(timeout)
        with self._lock:
            found, self._queue = self._queue, None
            mine = self._pid == os.getpid()
        if found is not None and mine:
            found.put(None)
        return written

    def _running(self) -> queue.SimpleQueue[_Item]:
        with self._lock:
            if self._queue is None or self._pid != os.getpid():
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(
                    target=self._run,
                    args=(self._queue,),
                    name="celery-outbox-strict-reports",
                    daemon=True,
                ).start()
            return self._queue

    def _run(self, items: queue.SimpleQueue[_Item]) -> None:
        try:
            while True:
                item = items.get()
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                self._write(*item)
        finally:
            connections.close_all()  # this thread's own

    def _write(
        self,
        write: Callable[[OrderingStore], int],
        alias: str,
        task_id: str,
        state: str,
    ) -> None:
        store = Stores(alias).ordering()
        try:
            try:
                write(store)
            except OutboxDatabaseError:
                store.reset_connection()
                write(store)
        except Exception:
            logger.exception(
                "strict ordering: cannot report task %s (%s); it runs again once "
                "its lease is over",
                task_id,
                state,
            )


#: The reporter of this process.
REPORTER = Reporter()


def _stop_reporter(**_: Any) -> None:
    if not REPORTER.stop(SHUTDOWN_SECONDS):
        logger.warning(
            "strict ordering: reports not written within %.0f s of the shutdown; "
            "their tasks run again once their leases are over",
            SHUTDOWN_SECONDS,
        )
