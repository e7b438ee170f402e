"""The delivering task: run the subscriber; on failure, retry on the broker or archive.

A failed subscriber's message is published again by the worker itself, into retry step
``n`` (a queue whose TTL holds it ``2^n`` s, then dead-letters it back to the
subscriber's queue only) with ``retries = n + 1``; after the last step it is published
to the service's archive. The original message is acked only after that publish
returned (with publisher confirms), so a crash in between redelivers it: nothing is
held in worker memory and the count is exact, which rejection-based routing cannot
give (a rejected message keeps its headers; only RabbitMQ's ``x-death`` counts it).
Rejections still happen (a time limit, an error while publishing the retry): the
queue dead-letters them into retry step 0, and their ``x-death`` count is added.

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
from celery.exceptions import Reject

from ..text import storable
from . import held
from .held import ERROR_HEADER, FAILED_AT_HEADER, HEADER_ERROR_LIMIT
from .modes import Retries
from .once import run_subscriber
from .registry import DELIVER_TASK, EVENT_HEADER, Subscriber, registry_of
from .topology import ServiceTopology, retry_delay

logger = logging.getLogger("celery_outbox.events")

__all__ = ["ERROR_HEADER", "FAILED_AT_HEADER", "Decision", "Fate", "decide", "deliver"]


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


def deliver(task: Any, *args: Any, **kwargs: Any) -> None:
    """Body of :data:`~.registry.DELIVER_TASK`: one event, one subscriber in this service."""
    request = task.request
    event = event_of(request)
    registry = registry_of(task.app)
    topology = registry.topology()
    subscriber = registry.subscriber_for(event) if isinstance(event, str) else None
    if subscriber is None:
        # A subscriber removed while its queue still held events: keep them for replay.
        queue = _queue_of(request)
        if not queue.startswith(f"{topology.prefix}:"):
            queue = f"{topology.prefix}:{event}"
        _archive(
            task,
            topology,
            queue,
            args,
            kwargs,
            _retries(request),
            f"no subscriber to {event!r} in this service",
        )
        return
    queue = topology.queue_name(subscriber.pattern)
    try:
        run_subscriber(subscriber.task, topology.service, str(request.id), args, kwargs)
    except Exception as exc:
        try:
            _after_failure(task, subscriber, topology, queue, exc, args, kwargs)
        except Exception as lost:
            if topology.retries is Retries.BROKER:
                raise  # rejected: the queue dead-letters it into retry step 0
            # Redis drops a message rejected without requeue: put it back instead.
            logger.error(
                "event %s (%s): its retry could not be written (%r); requeued",
                event,
                request.id,
                lost,
            )
            raise Reject(lost, requeue=True) from lost


def _after_failure(
    task: Any,
    subscriber: Subscriber,
    topology: ServiceTopology,
    queue: str,
    exc: Exception,
    args: Any,
    kwargs: Any,
) -> None:
    request = task.request
    retries = _retries(request)
    decision = decide(
        retries, subscriber.steps(), isinstance(exc, subscriber.retry_for)
    )
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
        if topology.retries is Retries.DATABASE:
            delay = retry_delay(decision.step)
            held.hold_retry(task, queue, args, kwargs, retries + 1, delay)
            return
        exchange = topology.retry_exchange(decision.step).name
        _republish(task, exchange, queue, args, kwargs, retries + 1, None)
        return
    logger.error(
        "event %s (%s) failed in %s after %d retries, archived: %r",
        event_of(request),
        request.id,
        subscriber.task.name,
        retries,
        exc,
    )
    _archive(task, topology, queue, args, kwargs, retries, repr(exc))


def _archive(
    task: Any,
    topology: ServiceTopology,
    queue: str,
    args: Any,
    kwargs: Any,
    retries: int,
    error: str,
) -> None:
    """Keep the event for replay: in the archive queue, or the outbox's dead letters."""
    if topology.retries is Retries.DATABASE:
        held.archive(task, queue, args, kwargs, retries, error)
    else:
        _republish(task, topology.archive_name, queue, args, kwargs, retries, error)


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
    """Publish the event again, same id, through a confirming connection of this worker.

    Celery's own ``send_task`` builds the message: ``OutboxCelery.send_task`` would
    route it through the outbox, while this copy must reach the broker before the
    original message is acked.
    """
    request = task.request
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
        exchange=exchange,
        routing_key=routing_key,
        retries=retries,
        headers=headers,
        root_id=request.root_id,
        parent_id=request.parent_id,
        declare=[],
        add_to_parent=False,
        ignore_result=True,
    )


_local = threading.local()


def _producer(app: Any) -> Any:
    """This thread's producer on a connection with publisher confirms."""
    producer = getattr(_local, "producer", None)
    if producer is None or producer.connection.connected is False:
        options = dict(app.conf.broker_transport_options or {})
        options["confirm_publish"] = True
        connection = app.connection_for_write(transport_options=options)
        producer = _local.producer = connection.Producer()
    return producer
