"""The delivering task: run the subscriber; on failure, retry on the broker or archive.

A failed subscriber's message is published again by the worker itself, into retry step
``n`` (a queue whose TTL holds it ``2^n`` s, then dead-letters it back to the
subscriber's queue only) with ``retries = n + 1``; after the last step it is published
to the service's archive. The original message is acked only after that publish
returned (with publisher confirms), so a crash in between redelivers it: nothing is
held in worker memory and the count is exact, which rejection-based routing cannot
give (a rejected message keeps its headers; only RabbitMQ's ``x-death`` counts it).
A rejection still happens when the retry cannot be published: the queue dead-letters
it into retry step 0, and its ``x-death`` count is added.

How the subscriber ended decides (:func:`decision_for`): an exception is a failure
(retried while it is in ``retry_for`` and steps remain), ``Reject(requeue=True)`` and
``Retry`` ask for a retry (the next step, whatever ``retry_for`` says),
``Reject(requeue=False)`` rejects it (archived at once), and ``Ignore`` ends it (acked,
nothing retried or archived). A hard time limit and a lost process end the delivery
outside this code; the worker's main process settles them the same way
(:func:`settle_outside`, called by :class:`~.endings.DeliveryRequest`).

Where the database holds the retries (Redis), :mod:`.held` writes the retry to the
outbox, due later, or the event to the dead letters; see there.
"""

from __future__ import annotations

import datetime
import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from kombu import Exchange, Queue

from ..text import storable
from . import held
from .held import ERROR_HEADER, FAILED_AT_HEADER, HEADER_ERROR_LIMIT
from .modes import Retries
from .once import run_subscriber
from .registry import (
    DELIVER_TASK,
    EVENT_HEADER,
    FIRST_SUBSCRIBER,
    Registry,
    Subscriber,
    registry_of,
)
from .topology import ServiceTopology, retry_delay

logger = logging.getLogger("celery_outbox.events")

#: The consumer defaults of the delivering task. Override any of them with Celery's
#: own ``task_annotations = {"celery_outbox.events.deliver": {"acks_late": False}}``.
#: A failed subscriber's event is settled by the task itself (retry or archive,
#: then ack), and a hard time limit or a lost process by its request class
#: (:class:`~.endings.DeliveryRequest`), whatever these say; they apply to what is
#: left to Celery.
CONSUMER_DEFAULTS: dict[str, Any] = {
    "acks_late": True,  # ack after the subscriber ran (or its retry was published)
    # A process lost while the worker shuts down cold: the message is redelivered.
    "reject_on_worker_lost": True,
    # A failure of the task itself (not of its subscriber): rejected, so RabbitMQ
    # dead-letters it into retry step 0.
    "acks_on_failure_or_timeout": False,
    # Celery 5.7's own retry of a lost task would send a second copy: the request
    # class retries it on the lane's schedule.
    "retry_on_worker_lost": False,
    "ignore_result": True,  # several services subscribe to one event: no single result
}
#: The delivering task's request class: settles the endings the main process sees.
REQUEST_CLASS = "celery_outbox.events.endings:DeliveryRequest"

__all__ = [
    "ERROR_HEADER",
    "FAILED_AT_HEADER",
    "Decision",
    "Fate",
    "decide",
    "decision_for",
    "deliver",
    "settle_outside",
]


class Fate(enum.Enum):
    """What happens to an event whose subscriber raised."""

    RETRY = "retry"
    ARCHIVE = "archive"


@dataclass(frozen=True)
class Decision:
    """The fate of a failed delivery; ``step`` is the retry step (0-based) for RETRY."""

    fate: Fate
    step: int = 0


def decide(retries: int, steps: int, retryable: bool) -> Decision:
    """Retry at step ``retries`` while steps remain and the error is retryable, else archive."""
    if retryable and retries < steps:
        return Decision(Fate.RETRY, retries)
    return Decision(Fate.ARCHIVE)


def decision_for(
    exc: BaseException,
    retries: int,
    steps: int,
    retry_for: tuple[type[BaseException], ...],
) -> Decision:
    """The fate of a delivery whose subscriber ended with ``exc`` (not ``Ignore``).

    ``Reject(requeue=False)``: the subscriber rejects the event, archived at once.
    ``Reject(requeue=True)`` and ``Retry`` (``self.retry()`` without an exception):
    it asks for a retry, the next step whatever ``retry_for`` says, counted like any
    retry, so it is archived after the last. Anything else is a failure, retried
    while it is one of ``retry_for`` (a hard time limit is ``TimeLimitExceeded``, a
    lost process ``WorkerLostError``).
    """
    requeue = bool(getattr(exc, "requeue", False))
    if isinstance(exc, Reject) and not requeue:
        return Decision(Fate.ARCHIVE)
    asked = isinstance(exc, (Reject, Retry))
    return decide(retries, steps, asked or isinstance(exc, retry_for))


@dataclass(frozen=True)
class _Target:
    """Where a delivery's retry or archive goes: its service, queue and subscriber."""

    topology: ServiceTopology
    queue: str
    #: None: no subscriber of this service matches the event (any more).
    subscriber: Subscriber | None


def _target(task: Any) -> _Target:
    request = task.request
    event = event_of(request)
    registry = registry_of(task.app)
    topology = registry.topology()
    subscriber = registry.subscriber_for(event) if event is not None else None
    if subscriber is not None:
        return _Target(topology, topology.queue_name(subscriber.pattern), subscriber)
    # A subscriber removed while its queue still held events: keep them for replay.
    queue = _queue_of(request)
    if not queue.startswith(f"{topology.prefix}:"):
        queue = f"{topology.prefix}:{event}"
    return _Target(topology, queue, None)


def deliver(task: Any, *args: Any, **kwargs: Any) -> None:
    """Body of :data:`~.registry.DELIVER_TASK`: one event, one subscriber in this service."""
    target = _target(task)
    if target.subscriber is None:
        _settle(task, target, None, args, kwargs)
        return
    try:
        run_subscriber(
            target.subscriber.task, target.topology.service, str(task.request.id),
            args, kwargs,
        )  # fmt: skip
    except Ignore:
        raise  # the subscriber ended the event itself: acked, nothing retried or kept
    except Exception as exc:
        _settle(task, target, exc, args, kwargs)


def register_deliver_task(registry: Registry) -> None:
    """Create the delivering task in ``registry``'s app (on its first subscriber)."""
    # Lazy (the app may not be finalized yet): the task is created on first use.
    # inbox=False: a retry is the same message (same id) again, which the inbox
    # of the delivering task itself would skip as a duplicate. A subscriber's own
    # inbox (``@app.subscriber(..., inbox=True)``) is applied by ``deliver``.
    registry.app.task(
        name=DELIVER_TASK,
        bind=True,
        inbox=False,
        shared=False,
        Request=REQUEST_CLASS,
        **CONSUMER_DEFAULTS,
    )(deliver)


FIRST_SUBSCRIBER.append(register_deliver_task)


def settle_outside(task: Any, exc: BaseException, args: Any, kwargs: Any) -> None:
    """Retry or archive a delivery that ended outside its process (``exc``: the hard
    time limit's ``TimeLimitExceeded``, a lost process's ``WorkerLostError``), as
    :func:`deliver` does for a subscriber that raised it.

    Called by the worker's main process with the delivery's request pushed on
    ``task``. Raises ``Reject`` (with the requeue the retries' holder needs) when the
    retry or archive could not be written.
    """
    _settle(task, _target(task), exc, args, kwargs)


def _settle(
    task: Any, target: _Target, exc: BaseException | None, args: Any, kwargs: Any
) -> None:
    """Publish (or write) the retry or the archive of a delivery whose subscriber
    ended with ``exc`` (None: it has no subscriber here).

    When that fails, RabbitMQ's TTL queues take it: ``Reject`` without requeue
    dead-letters it into retry step 0 (counted through ``x-death``). Where the
    database holds the retries (it is down, most likely), the event is published
    again to its queue as it came (:func:`_requeue`), and ``Reject`` with requeue
    is the last resort.
    """
    try:
        if target.subscriber is None or exc is None:
            event = event_of(task.request)
            error = f"no subscriber to {event!r} in this service"
            _archive(task, target, args, kwargs, _retries(task.request), error)
        else:
            _after_failure(task, target.subscriber, target, exc, args, kwargs)
        return
    except Exception as lost:
        unwritten = lost
    request = task.request
    if target.topology.retries is Retries.BROKER:
        logger.error(
            "event %s (%s): its retry could not be published (%r); rejected into "
            "retry step 0",
            event_of(request),
            request.id,
            unwritten,
        )
        raise Reject(unwritten, requeue=False) from unwritten
    try:
        _requeue(task, target, args, kwargs)
    except Exception as also:
        logger.error(
            "event %s (%s): its retry could not be written (%r) nor the event "
            "published again (%r); requeued",
            event_of(request),
            request.id,
            unwritten,
            also,
        )
        raise Reject(unwritten, requeue=True) from unwritten
    logger.error(
        "event %s (%s): its retry could not be written (%r); published again to %s",
        event_of(request),
        request.id,
        unwritten,
        target.queue,
    )


def _requeue(task: Any, target: _Target, args: Any, kwargs: Any) -> None:
    """Publish the running event again, as it came (same retries), to its own queue
    by name: what a requeue means, on every broker. kombu's Redis transport puts a
    requeued copy back by the routing its delivery info names: for a copy written
    before 0.2, the events exchange's, which sends it to every service's queue, or,
    through a channel that never declared the exchange, drops it."""
    retries = int(task.request.retries or 0)
    _republish(task, "", target.queue, args, kwargs, retries, None)


def _after_failure(
    task: Any,
    subscriber: Subscriber,
    target: _Target,
    exc: BaseException,
    args: Any,
    kwargs: Any,
) -> None:
    request = task.request
    retries = _retries(request)
    decision = decision_for(exc, retries, subscriber.steps(), subscriber.retry_for)
    if decision.fate is Fate.RETRY:
        logger.warning(
            "event %s (%s) failed in %s, retry %d in %.0f s: %r",
            event_of(request),
            request.id,
            subscriber.task.name,
            retries + 1,
            2**decision.step,
            exc,
        )
        if target.topology.retries is Retries.DATABASE:
            delay = retry_delay(decision.step)
            held.hold_retry(task, target.queue, args, kwargs, retries + 1, delay)
            return
        exchange = target.topology.retry_exchange(decision.step).name
        _republish(task, exchange, target.queue, args, kwargs, retries + 1, None)
        return
    logger.error(
        "event %s (%s) failed in %s after %d retries, archived: %r",
        event_of(request),
        request.id,
        subscriber.task.name,
        retries,
        exc,
    )
    _archive(task, target, args, kwargs, retries, repr(exc))


def _archive(
    task: Any, target: _Target, args: Any, kwargs: Any, retries: int, error: str
) -> None:
    """Keep the event for replay: in the archive queue, or the outbox's dead letters."""
    if target.topology.retries is Retries.DATABASE:
        held.archive(task, target.queue, args, kwargs, retries, error)
    else:
        name = target.topology.archive_name
        _republish(task, name, target.queue, args, kwargs, retries, error)


def event_of(request: Any) -> str | None:
    """The event's name: a request attribute from a worker, else in the headers
    (``apply()`` keeps custom headers there only)."""
    event = getattr(request, EVENT_HEADER, None) or (request.headers or {}).get(
        EVENT_HEADER
    )
    return event if isinstance(event, str) else None


def _retries(request: Any) -> int:
    """Retries so far: our count, plus the rejections RabbitMQ counted in ``x-death``."""
    rejected = 0
    for death in getattr(request, "x-death", None) or ():
        if isinstance(death, dict) and death.get("reason") == "rejected":
            rejected += int(death.get("count") or 0)
    return int(request.retries or 0) + rejected


def _queue_of(request: Any) -> str:
    return str((request.delivery_info or {}).get("routing_key") or "")


def _republish(
    task: Any,
    exchange: str,
    routing_key: str,
    args: Any,
    kwargs: Any,
    retries: int,
    error: str | None,
) -> None:
    """Publish the event again, same id, through a confirming connection of this worker
    (``exchange`` "": the default exchange, to the queue named ``routing_key`` only).

    Celery's own ``send_task`` builds the message: ``OutboxCelery.send_task`` would
    route it through the outbox, while this copy must reach the broker before the
    original message is acked.
    """
    request = task.request
    route: dict[str, Any] = {"exchange": exchange, "routing_key": routing_key}
    if not exchange:
        route = {"queue": Queue(routing_key, Exchange(""), routing_key=routing_key)}
    headers: dict[str, Any] = {EVENT_HEADER: event_of(request)}
    if error is not None:
        headers[ERROR_HEADER] = storable(error, HEADER_ERROR_LIMIT)
        headers[FAILED_AT_HEADER] = datetime.datetime.now(
            datetime.timezone.utc
        ).isoformat()
    Celery.send_task(
        task.app,
        DELIVER_TASK,
        args=list(args),
        kwargs=kwargs,
        task_id=request.id,
        producer=_producer(task.app),
        retries=retries,
        headers=headers,
        root_id=request.root_id,
        parent_id=request.parent_id,
        declare=[],
        add_to_parent=False,
        ignore_result=True,
        **route,
    )


_local = threading.local()


def _producer(app: Any) -> Any:
    """This thread's producer for ``app``'s broker, on a connection with publisher
    confirms (one per broker: a process may hold services on several)."""
    producers: dict[str, Any] = _local.__dict__.setdefault("producers", {})
    broker = str(app.conf.broker_write_url or app.conf.broker_url or "")
    producer = producers.get(broker)
    if producer is None or producer.connection.connected is False:
        options = dict(app.conf.broker_transport_options or {})
        options["confirm_publish"] = True
        connection = app.connection_for_write(transport_options=options)
        producer = producers[broker] = connection.Producer()
    return producer
