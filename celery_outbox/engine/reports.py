"""The worker's reports to the outbox, written by a thread of their own.

A worker tells the outbox how a watched task went (:mod:`.endings`): a strict
head's ending settles its row (:mod:`celery_outbox.ordering.worker`), a flow key's
task's start and end move its key's slot (:mod:`celery_outbox.flow.worker`). Each
report is written by a thread of the process that heard of it (:class:`Reporter`),
on a database connection of that thread: the task's process goes on to its next
task at once, and Celery's Django fix-up, which closes the task thread's
connections before and after every task, leaves the reporter's open. Nothing is
published on a report's strength before it is committed.

A report the database does not take is tried again, after the engine's backoff,
until it is written: a database restart delays a key's next task by the restart,
not by the lease. Reports of one slot (a flow task's start and end) coalesce, the
later one standing for both, so a long outage holds one report per task. A report
still unwritten when the worker ends (a bounded wait, :data:`SHUTDOWN_SECONDS`) is
logged by name; it, and a report of a process killed outright, is left to the
lease of what it reports on, the last net.

A worker's deletions of revoked tasks' rows (``celery_outbox.revoke.Withdrawals``)
are one more report of the same thread, retried the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
from collections.abc import Callable, Hashable
from typing import Any

from celery.signals import worker_process_shutdown, worker_shutdown
from django.db import connections

from ..conf import get_settings
from ..exceptions import OutboxDatabaseError
from ..store import Stores, outbox_alias
from .backoff import backoff

logger = logging.getLogger("celery_outbox.reports")

#: How long a worker process, as it ends, waits for its reports to be written.
SHUTDOWN_SECONDS = 10.0
#: The backoff between the tries of a report the database did not take.
RETRY_BASE_SECONDS = 0.5
RETRY_MAX_SECONDS = 10.0
#: Reports a process holds at most while the database does not answer (one per
#: slot); a report past it is refused, loudly, and left to its lease.
PENDING_LIMIT = 100_000


# -- the reporter thread -----------------------------------------------------------

#: What a report writes, given the stores of its alias; the rows it changed.
Write = Callable[[Stores], int]


@dataclasses.dataclass(eq=False)
class _Report:
    """One report: what it writes, on which alias, the task id and state it is for."""

    write: Write
    alias: str
    task_id: str
    state: str

    def __str__(self) -> str:
        return f"{self.task_id} ({self.state})"


class Reporter:
    """Writes one process's reports from a thread of its own, each until written.

    Started by the first report of a process (again after a fork: a thread does
    not survive one). Reports are written oldest first; one the database does not
    take (:class:`~celery_outbox.exceptions.OutboxDatabaseError`) goes to the back
    and is tried again on a new connection after the engine's backoff. A report
    that fails otherwise is a defect, not an outage: it is logged with its
    traceback and left to its lease.
    """

    def __init__(
        self,
        random_source: Callable[[], float] = random.random,
        limit: int = PENDING_LIMIT,
    ) -> None:
        self._random = random_source
        self._limit = limit
        self._reset()

    def _reset(self) -> None:
        self._changed = threading.Condition()
        #: Reports not written yet, by slot, oldest first.
        self._pending: dict[Hashable, _Report] = {}
        self._writing: _Report | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def send(
        self, write: Write, task_id: str, state: str, *, slot: Hashable = None
    ) -> None:
        """Queue one report, to be written until it is.

        ``slot``: what the report is about (a flow task's slot): a report of a
        slot that waits stands for those queued before it of the same slot. None:
        a report of its own. The outbox alias is resolved here, in the task's
        thread (a router may depend on that thread's state).
        """
        report = _Report(write, outbox_alias(get_settings()), task_id, state)
        with self._started():
            key = report if slot is None else slot
            if key not in self._pending and len(self._pending) >= self._limit:
                logger.error(
                    "%d reports wait for the outbox database already: task %s is "
                    "not reported; its lease is the net",
                    self._limit,
                    report,
                )
                return
            self._pending.pop(key, None)  # to the back: the newest of its slot
            self._pending[key] = report
            self._changed.notify_all()

    def wait(self, timeout: float) -> bool:
        """Until the reports queued so far are written (True), or ``timeout`` passed."""
        if self._pid != os.getpid():
            return True
        with self._changed:
            waited = {id(r) for r in self._pending.values()}
            if self._writing is not None:
                waited.add(id(self._writing))
            return self._changed.wait_for(lambda: not self._waiting(waited), timeout)

    def stop(self, timeout: float) -> list[str]:
        """Write what is queued (up to ``timeout``), then end the thread; the
        reports left unwritten (``"<task id> (<state>)"``)."""
        if self._pid != os.getpid():
            return []
        self.wait(timeout)
        with self._changed:
            self._stopped.set()
            left = [str(r) for r in self._pending.values()]
            self._pending.clear()
            self._changed.notify_all()
        return left

    def _waiting(self, reports: set[int]) -> bool:
        writing = self._writing
        return any(id(r) in reports for r in self._pending.values()) or (
            writing is not None and id(writing) in reports
        )

    def _started(self) -> threading.Condition:
        """The lock of the queue, the thread running (started again after a fork
        or a stop)."""
        if self._pid != os.getpid():
            self._reset()  # the parent's reports are the parent's to write
        with self._changed:
            thread = self._thread
            if thread is None or not thread.is_alive() or self._stopped.is_set():
                self._stopped = threading.Event()
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._stopped,),
                    name="celery-outbox-reports",
                    daemon=True,
                )
                self._thread.start()
        return self._changed

    def _run(self, stopped: threading.Event) -> None:
        failures = 0
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(
                        lambda: bool(self._pending) or stopped.is_set()
                    )
                    if stopped.is_set():
                        return
                    key, report = next(iter(self._pending.items()))
                    self._writing = report
                written = self._write(report)
                with self._changed:
                    self._writing = None
                    if self._pending.get(key) is report:
                        del self._pending[key]
                        if not written:
                            self._requeue(key, report)
                    self._changed.notify_all()
                failures = 0 if written else failures + 1
                if failures:
                    delay = backoff(
                        failures, RETRY_BASE_SECONDS, RETRY_MAX_SECONDS, self._random
                    )
                    logger.warning(
                        "cannot write task %s's report to the outbox (the database "
                        "does not answer): trying again in %.1f s",
                        report,
                        delay,
                    )
                    stopped.wait(delay)
        finally:
            connections.close_all()  # this thread's own

    def _requeue(self, key: Hashable, report: _Report) -> None:
        """Put a report the database did not take at the back, for the others'
        turn, with the later reports of its task behind it: a task's start is never
        written after its end (a slot would stay taken until its lease)."""
        later = [
            (k, r) for k, r in self._pending.items() if r.task_id == report.task_id
        ]
        for k, _ in later:
            del self._pending[k]
        self._pending[key] = report
        self._pending.update(later)

    def _write(self, report: _Report) -> bool:
        """Write ``report``; False when the database did not take it (to be tried
        again), True when it was written, or failed for good (logged)."""
        stores = Stores(report.alias)
        try:
            report.write(stores)
        except OutboxDatabaseError:
            stores.ordering().reset_connection()  # the next try reconnects
            return False
        except Exception:
            logger.exception(
                "cannot report task %s to the outbox; its lease is the net (a strict "
                "head runs again once it is over, a flow key's slot frees)",
                report,
            )
        return True


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
    left = REPORTER.stop(SHUTDOWN_SECONDS)
    if left:
        logger.error(
            "the worker ends with %d report(s) not written to the outbox (the "
            "database did not take them within %.0f s): their leases are the net "
            "(strict heads run again, flow keys' slots free when they end): %s",
            len(left),
            SHUTDOWN_SECONDS,
            ", ".join(left),
        )
