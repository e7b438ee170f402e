"""The worker's side of strict ordering: report when a strict task is done.

A strict head stays in the outbox, running, after it was published; the next row
of its key waits for it. Celery's public ``task_postrun`` signal (connected by
:class:`~celery_outbox.OutboxCelery`) tells the outbox that the task finished (the
row goes, and on PostgreSQL the relay is woken at once), will be retried (the key
stays held), or failed for good (the key's policy: block it, or dead-letter the head
and go on).

The reports are written by a thread of the worker process (:class:`Reporter`), on
a database connection of that thread: the task's process goes on to its next task
at once, and Celery's Django fix-up, which closes the task thread's connections
before and after every task, leaves the reporter's open. Before, each report
opened a connection and waited for its commit, which cost a strict task more than
its body. Nothing is published on a report's strength before it is committed, so
order holds; a report still queued when its process is killed is lost like the
report of a task killed mid-run: the head is published again once its running
lease (``CELERY_OUTBOX_STRICT_LEASE_SECONDS``, counted from the publish) is over.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from celery.signals import task_postrun, worker_process_shutdown, worker_shutdown
from django.db import connections

from ..conf import get_settings
from ..exceptions import OutboxDatabaseError
from ..store import OrderingStore, Stores, outbox_alias
from .core import Report, report_for
from .options import HEADER, Ordering, is_strict

logger = logging.getLogger("celery_outbox.ordering")

#: How long a worker process, as it ends, waits for its reports to be written.
SHUTDOWN_SECONDS = 10.0


def install() -> None:
    """Connect the reporting receivers once per process (idempotent)."""
    task_postrun.connect(
        _finished, weak=False, dispatch_uid="celery_outbox.strict.post"
    )
    # A prefork pool's process sends the first, the worker (solo, threads) the second.
    for ending in (worker_process_shutdown, worker_shutdown):
        ending.connect(
            _stop_reporter, weak=False, dispatch_uid="celery_outbox.strict.stop"
        )


def strict_headers(request: Any) -> Mapping[str, Any] | None:
    """The delivered message's headers when it is a strict head, else None.

    Custom headers reach ``request.headers`` (and, from a broker, also an attribute
    of the request named after the header).
    """
    if request is None or getattr(request, "is_eager", False):
        return None
    headers = getattr(request, "headers", None) or {}
    value = headers.get(HEADER) or getattr(request, HEADER, None)
    found = {HEADER: value} if value else {}
    return found if is_strict(found) else None


def wait_for_reports(timeout: float = SHUTDOWN_SECONDS) -> bool:
    """Block until this process's reports so far are written; False on timeout."""
    return REPORTER.wait(timeout)


def _finished(
    task: Any = None,
    task_id: str = "",
    retval: Any = None,
    state: str = "",
    **_: Any,
) -> None:
    headers = strict_headers(getattr(task, "request", None))
    if headers is None:
        return
    report = report_for(state)
    ordering = Ordering.read("", headers)
    try:
        _queue_report(report, task_id, state, retval, ordering)
    except Exception:
        # The lease stays the safety net: the head is published again after it.
        logger.exception("strict ordering: cannot report task %s (%s)", task_id, state)


def _queue_report(
    report: Report, task_id: str, state: str, retval: Any, ordering: Ordering
) -> None:
    row = ordering.row_token
    if report is Report.DONE:
        REPORTER.send(lambda store: store.task_done(task_id, row), task_id, state)
    elif report is Report.RETRYING:
        seconds = get_settings().strict_lease_seconds + _retry_delay(retval)
        REPORTER.send(
            lambda store: store.task_retrying(task_id, seconds, row), task_id, state
        )
    elif report is Report.FAILED:
        REPORTER.send(
            lambda store: _failed(store, task_id, retval, ordering), task_id, state
        )


def _failed(store: OrderingStore, task_id: str, exc: Any, ordering: Ordering) -> int:
    """Apply the key's policy; a report refused once is sent again without its text.

    The store makes the text storable; should the report fail all the same, the
    second one (on a new connection) records the failure's kind and why its text
    could not be recorded, so that the key's policy still applies and the attempt
    counts, instead of the task running again after every lease.
    """
    try:
        return store.task_failed(
            task_id, _error(exc), ordering.policy, ordering.row_token
        )
    except OutboxDatabaseError as refused:
        store.reset_connection()
        kind = type(exc).__name__ if isinstance(exc, BaseException) else "failure"
        note = f"{kind} (its text could not be recorded: {refused})"
        return store.task_failed(task_id, note, ordering.policy, ordering.row_token)


def _error(exc: Any) -> str:
    if isinstance(exc, BaseException):
        return f"{type(exc).__name__}: {exc}"
    return str(exc)


def _retry_delay(retry: Any) -> float:
    """Seconds until a retried task runs again (``Retry.when``: seconds or an eta)."""
    when = getattr(retry, "when", None)
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        return max(0.0, float(when))
    if isinstance(when, datetime.datetime):
        now = datetime.datetime.now(when.tzinfo or datetime.timezone.utc)
        if when.tzinfo is None:
            now = now.replace(tzinfo=None)
        return max(0.0, (when - now).total_seconds())
    return 0.0


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
