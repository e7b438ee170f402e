"""Celery's ``task-sent`` monitoring event, sent by the relay when it publishes.

With ``task_send_sent_event`` on, stock Celery sends a ``task-sent`` event as it
publishes a task, so Flower and ``celery events`` show the task before a worker takes
it. Through the outbox the call publishes nothing (the enqueue drops the event), and
the relay sends it instead, once the broker confirmed the message: one event per
published message, with the fields Celery puts in it, through Celery's own event
dispatcher. Only ``hostname``, ``pid``, ``clock`` and ``timestamp`` are the relay's.

Once per message, as stock Celery sends it once per call: a strict head published
again after its running lease (its worker never reported) is the same message sent
again, as a broker redelivers one, and sends no second event. A retry is a message
of its own, and has its own.
"""

from __future__ import annotations

from typing import Any

from ..envelope import Envelope
from .observations import BatchSettled, Observer, RelayObservation

#: The event's type, as Celery names it.
TASK_SENT = "task-sent"


def sent_fields(envelope: Envelope) -> dict[str, Any]:
    """The fields of the ``task-sent`` event Celery sends for this message.

    Celery builds them at the call (``celery.app.amqp``): the task's id, name,
    argument representations, retries, ETA and expiry, lineage, and where the
    message went. The stored message has each of them.
    """
    headers = envelope.headers
    return {
        "uuid": envelope.task_id,
        "root_id": headers.get("root_id"),
        "parent_id": headers.get("parent_id"),
        "name": envelope.task_name,
        "args": headers.get("argsrepr"),
        "kwargs": headers.get("kwargsrepr"),
        "retries": headers.get("retries"),
        "eta": headers.get("eta"),
        "expires": headers.get("expires"),
        # The queue the call named or routed to, which Celery also declared.
        "queue": envelope.declare[0] if envelope.declare else None,
        "exchange": envelope.exchange,
        "routing_key": envelope.routing_key,
    }


class TaskSentEvents:
    """A relay listener: a ``task-sent`` event for each message a batch published."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, event: RelayObservation) -> None:
        """Send the events of one settled batch (published and strict-held rows)
        for the messages published for the first time."""
        if not isinstance(event, BatchSettled):
            return
        settlement = event.settlement
        published = set(settlement.delete)
        published.update(d.message_id for d in settlement.hold)
        messages = [m for m in event.messages if m.id in published and not m.republish]
        if not messages:
            return
        with self.app.events.default_dispatcher() as dispatcher:
            for message in messages:
                dispatcher.send(TASK_SENT, **sent_fields(message.envelope))


def sent_event_observers(app: Any) -> list[Observer]:
    """``[TaskSentEvents(app)]`` when the app has ``task_send_sent_event`` on, else none."""
    if app.conf.task_send_sent_event:
        return [TaskSentEvents(app)]
    return []
