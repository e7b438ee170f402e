"""The worker's reports to the outbox, written by a thread of their own.

A worker tells the outbox how a watched task went (:mod:`.endings`): a strict
head's ending settles its row (:mod:`celery_outbox.ordering.worker`), a flow key's
task's start and end move its key's slot (:mod:`celery_outbox.flow.worker`). Each
report is written by a thread of the process that heard of it (:class:`Reporter`),
on a database connection of that thread: the task's process goes on to its next
task at once, and Celery's Django fix-up, which closes the task thread's
connections before and after every task, leaves the reporter's open. Nothing is
published on a report's strength before it is committed; a report still queued
when its process is killed is lost like the report of a task killed with its
worker, and the lease of what it reports on is the safety net.

A worker's deletions of revoked tasks' rows (``celery_outbox.revoke.Withdrawals``)
go through the same thread, as one report that retries until its ids are deleted.
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
from ..store import Stores, outbox_alias

logger = logging.getLogger("celery_outbox.reports")

#: How long a worker process, as it ends, waits for its reports to be written.
SHUTDOWN_SECONDS = 10.0


# -- the reporter thread -----------------------------------------------------------

#: What a report writes, given the stores of its alias; the rows it changed.
Write = Callable[[Stores], int]
#: One report: what it writes, on which alias, and the task id and state it is for.
_Report = tuple[Write, str, str, str]
#: What the reporter's queue carries: a report, a marker to set once every report
#: before it is written, or None to end the thread.
_Item = _Report | threading.Event | None


class Reporter:
    """Writes one process's reports, in order, from a thread of its own.

    Started by the first report of a process (again after a fork: a thread does
    not survive one). A report that fails is sent once more on a new connection
    (the kept one may have gone with a database restart; the statements are
    idempotent), then logged: the lease stays the safety net.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Item] | None = None
        self._pid = 0

    def send(self, write: Write, task_id: str, state: str) -> None:
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
                    name="celery-outbox-reports",
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

    def _write(self, write: Write, alias: str, task_id: str, state: str) -> None:
        stores = Stores(alias)
        try:
            try:
                write(stores)
            except OutboxDatabaseError:
                stores.ordering().reset_connection()
                write(stores)
        except Exception:
            logger.exception(
                "cannot report task %s (%s) to the outbox; its lease is the safety "
                "net (a strict head runs again once it is over, a flow key's slot "
                "frees)",
                task_id,
                state,
            )


#: The reporter of this process.
REPORTER = Reporter()


def install() -> None:
    """Write what is queued when a worker process or the worker ends (idempotent)."""
    # A prefork pool's process sends the first, the worker (solo, threads, and the
    # prefork pool's main process, which reports revokes and time limits) the second.
    for ending in (worker_process_shutdown, worker_shutdown):
        ending.connect(_stop_reporter, weak=False, dispatch_uid="celery_outbox.reports")


def wait_for_reports(timeout: float = SHUTDOWN_SECONDS) -> bool:
    """Block until this process's reports so far are written; False on timeout."""
    return REPORTER.wait(timeout)


def _stop_reporter(**_: Any) -> None:
    if not REPORTER.stop(SHUTDOWN_SECONDS):
        logger.warning(
            "reports not written within %.0f s of the shutdown: their leases are "
            "the safety net (strict heads run again, flow keys' slots free)",
            SHUTDOWN_SECONDS,
        )
