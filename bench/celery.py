"""The benchmark's Celery apps: the OutboxCelery under test and plain ones to compare."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu.serialization import dumps

from celery_outbox import OutboxCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

from bench import env

app = OutboxCelery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")


def _noop(number: int) -> int:
    """The benchmark task; no worker runs it."""
    return number


noop = app.task(name=env.TASK_NAME)(_noop)


def plain_app(kind: str) -> Celery:
    """A plain ``celery.Celery`` on the ``amqp`` or ``redis`` broker, same queue."""
    from django.conf import settings

    plain = Celery(f"bench-plain-{kind}", set_as_current=False)
    config: dict[str, Any] = {
        "broker_url": env.broker_url(kind),
        "task_queues": settings.CELERY_TASK_QUEUES,
        "task_default_queue": env.QUEUE,
        "task_default_exchange": env.QUEUE,
        "task_default_routing_key": env.QUEUE,
        "task_ignore_result": True,
    }
    plain.conf.update(config)
    return plain


class DiscardingProducer:
    """A producer that serializes each message as kombu's does, then drops it.

    Handed to a plain Celery app's ``send_task``, it leaves what Celery itself costs
    per ``delay()``: building the message, routing it, the publish signals and the
    body's serialization, with no broker and no database.
    """

    def __init__(self, connection: Any) -> None:
        #: Celery wraps the publish in ``connection._reraise_as_library_errors()``.
        self.connection = connection

    def publish(self, body: Any, serializer: str | None = None, **kwargs: Any) -> None:
        dumps(body, serializer=serializer)


def celery_only() -> tuple[Any, DiscardingProducer]:
    """The benchmark task on a plain ``celery.Celery`` with the same configuration,
    and the producer to pass as its ``producer=``."""
    plain = Celery("bench-celery-only", set_as_current=False)
    plain.config_from_object("django.conf:settings", namespace="CELERY")
    task = plain.task(name=env.TASK_NAME, shared=False, lazy=False)(_noop)
    if task.app is not plain:
        raise RuntimeError("the Celery-only task is bound to another app")
    return task, DiscardingProducer(plain.connection_for_write())
