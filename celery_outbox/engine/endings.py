"""How Celery ended a delivered task: one :class:`TaskEnd` per ending, from its signals.

The worker reports to the outbox how a watched task ended: a strict head stays in
the outbox until then (an ending nobody reports holds the key until the running
lease is over, and then the head is published again), and a flow key's task holds
a slot of its key until then (or until the slot's lease is over). Celery tells the endings through several signals, some in
the pool's child that ran the task, some in the worker's main process, and not the
same in every release. This module is the one place that connects them; each
receiver turns its signal into an :class:`Ending` (:func:`ending_after_run`,
:func:`ending_of_failure`, :func:`ending_of_revoke`) and hands a :class:`TaskEnd` to
the recipients :func:`install` was given: the strict reporter
(:mod:`celery_outbox.ordering.worker`), which settles the row as
:func:`~celery_outbox.ordering.core.report_for` says, and the flow reporter
(:mod:`celery_outbox.flow.worker`), which frees the key's slot.

Which signal tells which ending (a prefork pool; solo and threads pools run
everything in the main process):

* succeeded, failed, rejected or requeued (``Reject``), ignored, replaced:
  ``task_postrun``, its state and return value, in the child that ran the task
  (a ``Reject(requeue=True)`` requeues an ``acks_late`` task's message only: any
  other's was acknowledged as its run began);
* retried: ``task_retry``, in the child (``self.retry()``, autoretry), or in the
  main process (5.7's ``retry_on_worker_lost``, a cancel on a lost connection);
* revoked, expired, terminated: ``task_revoked``, in the main process only;
* timed out (the hard time limit killed the child): ``task_failure`` with
  ``TimeLimitExceeded``, in the main process;
* lost (the child died): ``task_failure`` with ``WorkerLostError``, in the main
  process; none when Celery requeues it (``acks_late`` with
  ``reject_on_worker_lost``): its next run reports;
* refused (an unknown task, a message the worker cannot read): ``task_unknown``
  and ``task_rejected``, in the main process's consumer.

Celery differs between releases here, and the receivers allow for it: 5.7 sends
``task_failure`` for a hard time limit twice (``on_timeout`` and ``on_failure``;
the second report finds the row settled), and sends it even for an ``acks_late``
task it then requeues (``acks_on_timeout`` off: :func:`ending_of_failure` says
requeued); 5.5 and 5.6 requeue that task without a signal (its next run reports);
5.7 also sends ``task_failure`` in the main process for ``Reject(requeue=False)``,
which ``task_postrun`` already told. ``task_postrun``'s ``RETRY`` is left to
``task_retry``, which every retry sends, in whichever process made it.

The main process's ``task_failure`` names only the task id: the delivered request
(with the message's headers) is kept from ``task_received`` in a weak mapping, so
it goes with the request.
"""

from __future__ import annotations

import datetime
import enum
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import states
from celery.exceptions import (
    Ignore,
    NotRegistered,
    Reject,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery.signals import (
    task_failure,
    task_postrun,
    task_received,
    task_rejected,
    task_retry,
    task_revoked,
    task_unknown,
)

from ..flow_limits import FLOW_HEADER, KEY_HEADER
from ..ordering_options import HEADER, is_strict


class Ending(enum.Enum):
    """How Celery ended one delivery of a task, as its worker's signals tell it.

    This module turns each signal into one of these; the table of which signal
    says what, in which process and Celery version, is above.
    """

    SUCCEEDED = "succeeded"  # the body returned
    FAILED = "failed"  # the body raised, no retry left
    RETRIED = "retried"  # self.retry()/autoretry, a retry after a lost worker, a cancel
    REQUEUED = "requeued"  # Reject(requeue=True), a time limit's requeue (acks_late)
    #: Reject(requeue=True) of a message acknowledged when its run began (no
    #: ``acks_late``): Celery's reject does nothing, the message is gone.
    NOT_REQUEUED = "not_requeued"
    REJECTED = "rejected"  # Reject(requeue=False): the message is dropped
    IGNORED = "ignored"  # Ignore: the task chose to record no state
    REPLACED = "replaced"  # self.replace(): the replacement carries the task on
    REVOKED = "revoked"  # revoked before it started
    EXPIRED = "expired"  # its ``expires`` passed before it started
    TERMINATED = "terminated"  # revoke(terminate=True) while it ran
    TIMED_OUT = "timed_out"  # the hard time limit killed it
    LOST = "lost"  # its worker process died under it (WorkerLostError)
    REFUSED = "refused"  # the worker cannot run it (unknown task, invalid message)


@dataclass(frozen=True)
class TaskEnd:
    """One delivered task that ended, and how, for a message the outbox must hear of."""

    ending: Ending
    task_id: str
    #: The delivered message's headers the outbox watches: the ordering header
    #: (:data:`~celery_outbox.ordering_options.HEADER`), the flow and flow key.
    headers: Mapping[str, Any]
    #: What ended a failed task, as it is recorded: ``ValueError: text`` for the
    #: task's own exception, Celery's own wording for a rejection, a time limit or a
    #: refused message.
    error: str = ""
    #: The exception's type name alone, recorded when its text cannot be.
    kind: str = ""
    #: Seconds until a retried task runs again (``Retry.when``).
    delay: float = 0.0


#: Who hears of each ending (set by :func:`install`).
Recipient = Callable[[TaskEnd], None]


class Replaced(Ignore):
    """``self.replace()`` of a strict head whose replacement carries its report.

    Celery ends a replaced task with ``Ignore``; this one says that the task with
    the same id that replaces it will report in its stead (set by
    :meth:`celery_outbox.ordering.task.OrderingMixin.on_replace`).
    """


_recipients: list[Recipient] = []
#: Delivered watched requests, by task id, while the main process holds them.
_delivered: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def install(recipient: Recipient) -> None:
    """Connect Celery's signals once per process; ``recipient`` hears every ending."""
    if recipient not in _recipients:
        _recipients.append(recipient)
    for signal, receiver in (
        (task_postrun, _after_run),
        (task_retry, _retried),
        (task_revoked, _revoked),
        (task_received, _received),
        (task_failure, _failed_outside),
        (task_unknown, _unknown),
        (task_rejected, _rejected),
    ):
        uid = f"celery_outbox.endings.{receiver.__name__}"
        signal.connect(receiver, weak=False, dispatch_uid=uid)


#: The headers that make a delivered task one the worker reports on.
WATCHED = (HEADER, FLOW_HEADER, KEY_HEADER)


def watched_headers(request: Any) -> Mapping[str, Any] | None:
    """The watched headers of a delivered task (a strict head, a flow key's task),
    else None.

    ``request`` is a task's request (a ``Context``): custom headers reach its
    ``headers`` and, from a broker, an attribute named after the header.
    """
    if request is None or getattr(request, "is_eager", False):
        return None
    headers = getattr(request, "headers", None) or {}
    return watched_in(
        {name: headers.get(name) or getattr(request, name, None) for name in WATCHED}
    )


def watched_in(headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A message's watched headers when it is a strict head or a flow key's task,
    else None."""
    found = {name: value for name in WATCHED if (value := (headers or {}).get(name))}
    if is_strict(found) or (FLOW_HEADER in found and KEY_HEADER in found):
        return found
    return None


# -- what each signal says ---------------------------------------------------------


def ending_after_run(
    state: str | None, retval: Any, acks_late: bool = True
) -> Ending | None:
    """The ending ``task_postrun`` tells: its state, and for some its return value.

    None for a retry (``task_retry`` tells it) and for a run cut short before its
    state was known. A ``Reject(requeue=True)`` puts the message back only when
    the task acknowledges late (``acks_late``): otherwise Celery acknowledged it
    as the run began, and its reject does nothing.
    """
    if state == states.SUCCESS:
        return Ending.SUCCEEDED
    if state == states.FAILURE:
        return Ending.FAILED
    if state == states.REJECTED:
        requeue = isinstance(retval, Reject) and bool(getattr(retval, "requeue", 0))
        if not requeue:
            return Ending.REJECTED
        return Ending.REQUEUED if acks_late else Ending.NOT_REQUEUED
    if state == states.IGNORED:
        return Ending.REPLACED if isinstance(retval, Replaced) else Ending.IGNORED
    return None


def ending_of_failure(exception: Any, task: Any) -> Ending | None:
    """The ending a ``task_failure`` of the worker's main process tells, else None.

    A task's own exception is told by ``task_postrun`` in the process that ran it.
    A hard time limit on an ``acks_late`` task whose ``acks_on_timeout`` (Celery
    5.7) is off requeues the message after the signal: it runs again.
    """
    if isinstance(exception, TimeLimitExceeded):
        acks_on_timeout = getattr(task, "acks_on_timeout", None)
        requeued = (
            bool(getattr(task, "acks_late", False))
            and acks_on_timeout is not None
            and not acks_on_timeout
        )
        return Ending.REQUEUED if requeued else Ending.TIMED_OUT
    if isinstance(exception, WorkerLostError):
        return Ending.LOST
    return None


def ending_of_revoke(terminated: bool, expired: bool) -> Ending:
    """The ending a ``task_revoked`` tells."""
    if terminated:
        return Ending.TERMINATED
    return Ending.EXPIRED if expired else Ending.REVOKED


def retry_delay(retry: Any) -> float:
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


def _error(exc: Any) -> tuple[str, str]:
    """A task's own exception as recorded (``Type: text``), and its type's name."""
    if isinstance(exc, BaseException):
        return f"{type(exc).__name__}: {exc}", type(exc).__name__
    return str(exc), "failure"


def _celerys(exc: Any) -> tuple[str, str]:
    """An exception Celery raised (a rejection, a time limit), in Celery's wording."""
    return repr(exc), type(exc).__name__


# -- the receivers -----------------------------------------------------------------


def _deliver(end: TaskEnd) -> None:
    for recipient in _recipients:
        recipient(end)


def _after_run(
    task: Any = None,
    task_id: str = "",
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    headers = watched_headers(getattr(task, "request", None))
    if headers is None:
        return
    ending = ending_after_run(state, retval, bool(getattr(task, "acks_late", False)))
    if ending is None:
        return
    error, kind = ("", "")
    if ending is Ending.FAILED:
        error, kind = _error(retval)
    elif ending is Ending.REJECTED:
        error, kind = _celerys(retval)
    _deliver(TaskEnd(ending, str(task_id), headers, error, kind))


def _retried(request: Any = None, reason: Any = None, **_: Any) -> None:
    headers = watched_headers(request)
    if headers is None:
        return
    delay = retry_delay(reason)
    _deliver(TaskEnd(Ending.RETRIED, str(request.id), headers, delay=delay))


def _revoked(
    request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    headers = watched_headers(request)
    if headers is None:
        return
    ending = ending_of_revoke(bool(terminated), bool(expired))
    _deliver(TaskEnd(ending, str(request.id), headers))


def _received(request: Any = None, **_: Any) -> None:
    dict_ = getattr(request, "request_dict", None)
    if watched_in(dict_) is not None:
        _delivered[str(request.id)] = request


def _failed_outside(
    sender: Any = None, task_id: str = "", exception: Any = None, **_: Any
) -> None:
    ending = ending_of_failure(exception, sender)
    if ending is None:
        return
    request = _delivered.get(str(task_id))
    headers = watched_in(getattr(request, "request_dict", None))
    if headers is None:
        return
    error, kind = _celerys(exception) if ending is Ending.TIMED_OUT else ("", "")
    _deliver(TaskEnd(ending, str(task_id), headers, error, kind))


def _unknown(message: Any = None, name: str = "", id: str = "", **_: Any) -> None:
    headers = watched_in(getattr(message, "headers", None))
    if headers is None:
        return
    error, kind = _celerys(NotRegistered(name))
    _deliver(TaskEnd(Ending.REFUSED, str(id), headers, error, kind))


def _rejected(message: Any = None, exc: Any = None, **_: Any) -> None:
    found = getattr(message, "headers", None) or {}
    headers = watched_in(found)
    if headers is None or not found.get("id"):
        return
    error, kind = _celerys(exc) if exc is not None else ("rejected", "Rejected")
    _deliver(TaskEnd(Ending.REFUSED, str(found["id"]), headers, error, kind))
