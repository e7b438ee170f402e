"""Retries held by the database: a failed event becomes an outbox row due later.

Where the broker cannot hold a retry (Redis), the worker writes the same message
(same task id, ``retries = n + 1``) to the outbox, due ``2^n`` seconds from now and
addressed to the subscriber's queue by name, so only that queue gets it again; the
relay publishes it when it is due. After the last step the message is written to
the outbox's dead letters instead (``outbox tasks replay`` puts it back, with a fresh
retry count). Either write commits in a transaction of its own, after the
subscriber's transaction rolled back and before the message is acknowledged: a crash
in between redelivers the event (a duplicate), it never loses it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from django.db import transaction
from kombu import Exchange, Queue

from ..enqueue import CapturingProducer, announce_written
from ..envelope import Envelope
from ..store import outbox_stores
from ..text import storable
from .registry import DELIVER_TASK, EVENT_HEADER

#: Headers a held event carries: why it failed, when, and after how many retries.
ERROR_HEADER = "outbox_error"
FAILED_AT_HEADER = "outbox_failed_at"
RETRIES_HEADER = "outbox_retries"
#: Characters of the error kept in :data:`ERROR_HEADER`.
HEADER_ERROR_LIMIT = 1000


def hold_retry(
    task: Any, queue: str, args: Any, kwargs: Any, retries: int, delay: float
) -> None:
    """Write the running event back to the outbox, due in ``delay`` seconds, for
    ``queue`` only, with Celery's ``retries`` header set to ``retries``."""
    envelope = capture(task, queue, args, kwargs, retries, {})
    stores = outbox_stores()
    with transaction.atomic(using=stores.alias):
        stores.events().insert_later([envelope], delay)
        announce_written([envelope], stores.alias)


def archive(
    task: Any, queue: str, args: Any, kwargs: Any, retries: int, error: str
) -> None:
    """Write the running event to the dead letters, ready to replay with a fresh
    retry count (the count it reached is kept in ``outbox_retries``)."""
    failed_at = datetime.datetime.now(datetime.timezone.utc).isoformat()
    extra = {
        ERROR_HEADER: storable(error, HEADER_ERROR_LIMIT),
        FAILED_AT_HEADER: failed_at,
        RETRIES_HEADER: retries,
    }
    envelope = capture(task, queue, args, kwargs, 0, extra)
    stores = outbox_stores()
    with transaction.atomic(using=stores.alias):
        stores.events().insert_dead([envelope], error)


def capture(
    task: Any,
    queue: str,
    args: Any,
    kwargs: Any,
    retries: int,
    extra_headers: Mapping[str, Any],
) -> Envelope:
    """The running event's message for ``queue`` as Celery builds it (same id and
    lineage, ``retries`` set), captured instead of sent."""
    request = task.request
    app = task.app
    captured: list[Envelope] = []

    def keep(envelopes: Sequence[Envelope]) -> Mapping[str, str]:
        captured.extend(envelopes)
        return {}

    connection = app.connection_for_write()
    producer = CapturingProducer(
        connection=connection,
        default_serializer=app.conf.task_serializer,
        default_compression=app.conf.task_compression,
        sink=keep,
        amqp=getattr(connection.transport, "driver_type", "") == "amqp",
    )
    event = getattr(request, EVENT_HEADER, None) or (request.headers or {}).get(
        EVENT_HEADER
    )
    headers = {EVENT_HEADER: event, **extra_headers}
    # Celery's own send_task: OutboxCelery's would route a message with the running
    # task's id straight to the broker (that is how Task.retry works).
    options: dict[str, Any] = {
        "producer": producer,
        # The default exchange, by the queue's name: to that queue only.
        "queue": Queue(queue, exchange=Exchange(""), routing_key=queue),
        "declare": [],
    }
    Celery.send_task(
        app,
        DELIVER_TASK,
        args=list(args),
        kwargs=kwargs,
        task_id=request.id,
        retries=retries,
        headers=headers,
        root_id=request.root_id,
        parent_id=request.parent_id,
        add_to_parent=False,
        ignore_result=True,
        **options,
    )
    (envelope,) = captured
    return envelope
