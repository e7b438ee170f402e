"""The benchmark's Celery apps: the OutboxCelery under test and plain ones to compare."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_outbox import OutboxCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

from bench import env

app = OutboxCelery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(name=env.TASK_NAME)
def noop(number: int) -> int:
    """The benchmark task; no worker runs it."""
    return number


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
