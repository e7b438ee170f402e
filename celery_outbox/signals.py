"""Django signals sent by celery-outbox.

Every signal is sent with ``send_robust``: a receiver that raises is logged and never
breaks the caller's transaction or the relay's settlement. The sender is the
:class:`~celery_outbox.models.OutboxMessage` model.

The signals observe the lanes; no lane imports them. :func:`send_created` subscribes
to the rows the enqueue path writes (:data:`celery_outbox.enqueue.WRITTEN`, from
:mod:`celery_outbox.apps`), and :func:`send_relay_signals` is handed to each relay as
an observer (by ``outbox relay``'s runner, and by the app for publish-on-commit).

``message_created(task_id, task_name, queue, using)``
    A row was written, inside the caller's transaction (before commit).
``message_published(task_id, task_name, queue, attempts)``
    The broker confirmed the message; the row is gone.
``message_failed(task_id, task_name, queue, error, attempts, retry_in)``
    The broker refused the message; it is retried in ``retry_in`` seconds.
``message_dead_lettered(task_id, task_name, queue, error, attempts)``
    The message used up its attempts and moved to the dead-letter table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections, transaction
from django.dispatch import Signal

from .envelope import Envelope, StoredMessage
from .relay.observations import BatchSettled, Coalesced, RelayObservation

logger = logging.getLogger("celery_outbox.signals")

message_created = Signal()
message_published = Signal()
message_failed = Signal()
message_dead_lettered = Signal()
#: A row was deleted at claim time, unpublished: a newer one of its coalescing
#: group (task name, ordering key) waits. Arguments: task_id, task_name, ordering_key.
message_coalesced = Signal()


#: Django 6.1 renamed ``transaction.savepoint()`` (deprecated there) to
#: ``savepoint_create()``; earlier versions have only the old name.
_savepoint_create: Callable[..., str] = getattr(
    transaction, "savepoint_create", transaction.savepoint
)


def _sender() -> Any:
    from .models import OutboxMessage

    return OutboxMessage


def _send(signal: Signal, **kwargs: Any) -> bool:
    """Send robustly; True if every receiver returned normally."""
    ok = True
    for receiver, response in signal.send_robust(sender=_sender(), **kwargs):
        if isinstance(response, Exception):
            ok = False
            logger.error(
                "celery-outbox signal receiver %r failed: %s: %s",
                receiver,
                type(response).__name__,
                response,
                exc_info=response,
            )
    return ok


def send_created(envelopes: Sequence[Envelope], using: str) -> None:
    """Send ``message_created`` for freshly written rows, shielding the caller's transaction.

    Inside ``atomic()`` the receivers run under a savepoint: if one fails (even with a
    database error), their writes are rolled back to it and the caller's transaction
    and the outbox rows stay intact.
    """
    if not message_created.receivers or not message_created.has_listeners(_sender()):
        return  # the first test costs nothing when nobody is connected
    connection = connections[using]
    savepoint = _savepoint_create(using=using) if connection.in_atomic_block else None
    ok = True
    for envelope in envelopes:
        ok = (
            _send(
                message_created,
                task_id=envelope.task_id,
                task_name=envelope.task_name,
                queue=envelope.queue,
                using=using,
            )
            and ok
        )
    if savepoint is not None:
        if ok:
            transaction.savepoint_commit(savepoint, using=using)
        else:
            transaction.savepoint_rollback(savepoint, using=using)


def send_relay_signals(event: RelayObservation) -> None:
    """Relay listener: one Django signal per settled message, after the settlement committed."""
    if isinstance(event, Coalesced):
        for row in event.rows:
            _send(
                message_coalesced,
                task_id=row.task_id,
                task_name=row.task_name,
                ordering_key=row.ordering_key,
            )
        return
    if not isinstance(event, BatchSettled):
        return
    by_id: dict[int, StoredMessage] = {m.id: m for m in event.messages}

    def common(message: StoredMessage) -> dict[str, Any]:
        return {
            "task_id": message.envelope.task_id,
            "task_name": message.envelope.task_name,
            "queue": message.envelope.queue,
        }

    published = (
        *event.settlement.delete,
        *(d.message_id for d in event.settlement.hold),
    )
    for message_id in published:
        message = by_id[message_id]
        _send(message_published, attempts=message.attempts + 1, **common(message))
    for decision in event.settlement.retry:
        message = by_id[decision.message_id]
        _send(
            message_failed,
            error=decision.error,
            attempts=message.attempts + 1,
            retry_in=decision.delay,
            **common(message),
        )
    for decision in event.settlement.dead_letter:
        message = by_id[decision.message_id]
        _send(
            message_dead_lettered,
            error=decision.error,
            attempts=message.attempts + 1,
            **common(message),
        )
