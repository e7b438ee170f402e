"""The worker's side of strict ordering: report when a strict task is done.

A strict head stays in the outbox, running, after it was published; the next row
of its key waits for it. Celery's public ``task_prerun`` and ``task_postrun``
signals (connected by :class:`~celery_outbox.OutboxCelery`) tell the outbox: the
task began (its running lease starts again), finished (the row goes, and on
PostgreSQL the relay is woken at once), will be retried (the key stays held), or
failed for good (the key's policy: block it, or dead-letter the head and go on).

A worker killed mid-task reports nothing: the head is published again once its
running lease (``CELERY_OUTBOX_STRICT_LEASE_SECONDS``) is over.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any

from celery.signals import task_postrun, task_prerun

from ..conf import get_settings
from ..exceptions import OutboxDatabaseError
from .core import Report, report_for
from .options import HEADER, Ordering, is_strict

logger = logging.getLogger("celery_outbox.ordering")


def install() -> None:
    """Connect the reporting receivers once per process (idempotent)."""
    task_prerun.connect(_started, weak=False, dispatch_uid="celery_outbox.strict.pre")
    task_postrun.connect(
        _finished, weak=False, dispatch_uid="celery_outbox.strict.post"
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


def _store() -> Any:
    # Imported here: the app (and these receivers) load before Django's models.
    from ..enqueue import outbox_alias
    from ..store import OutboxStore

    return OutboxStore(outbox_alias(get_settings()))


def _started(task: Any = None, task_id: str = "", **_: Any) -> None:
    headers = strict_headers(getattr(task, "request", None))
    if headers is None:
        return
    row = Ordering.read("", headers).row_token
    try:
        _store().task_started(task_id, get_settings().strict_lease_seconds, row)
    except Exception:
        logger.exception("strict ordering: cannot renew the lease of task %s", task_id)


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
        store = _store()
        if report is Report.DONE:
            store.task_done(task_id, ordering.row_token)
        elif report is Report.FAILED:
            _failed(store, task_id, retval, ordering)
        elif report is Report.RETRYING:
            seconds = get_settings().strict_lease_seconds + _retry_delay(retval)
            store.task_retrying(task_id, seconds, ordering.row_token)
    except Exception:
        # The lease stays the safety net: the head is published again after it.
        logger.exception("strict ordering: cannot report task %s (%s)", task_id, state)


def _failed(store: Any, task_id: str, exc: Any, ordering: Ordering) -> None:
    """Apply the key's policy; a report refused once is sent again without its text.

    The store makes the text storable; should the report fail all the same, the
    second one (on a new connection) records the failure's kind and why its text
    could not be recorded, so that the key's policy still applies and the attempt
    counts, instead of the task running again after every lease.
    """
    try:
        store.task_failed(task_id, _error(exc), ordering.policy, ordering.row_token)
    except OutboxDatabaseError as refused:
        store.reset_connection()
        kind = type(exc).__name__ if isinstance(exc, BaseException) else "failure"
        note = f"{kind} (its text could not be recorded: {refused})"
        store.task_failed(task_id, note, ordering.policy, ordering.row_token)


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
