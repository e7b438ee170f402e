"""The benchmark's Celery apps: the OutboxCelery under test and plain ones to compare."""

from __future__ import annotations

import functools
import os
import time
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

#: The Redis list where ``bench.ordered`` records its runs (the strict part reads it);
#: named after the run's queue, so the bench's clean-up deletes it.
RUNS_KEY = f"{env.QUEUE}:runs"


@functools.cache
def _runs() -> Any:
    import redis

    return redis.Redis.from_url(env.REDIS_URL, socket_timeout=30)


def _ordered(tag: str, seconds: float = 0.0) -> str:
    """Sleep ``seconds``, then append ``"<tag> <pid> <start> <end>"`` to the runs.

    :data:`RUNS_KEY` keeps the appends of every worker process in one order: a key's
    runs can be checked against it, and the last end is when the last run ended.
    The times are the machine's monotonic clock.
    """
    start = time.monotonic()
    time.sleep(seconds)
    _runs().rpush(RUNS_KEY, f"{tag} {os.getpid()} {start:.6f} {time.monotonic():.6f}")
    return tag


ordered = app.task(name="bench.ordered")(_ordered)

#: The flow part's task (``bench.flow``): the flow's rate decides when it is published.
flowed = app.task(name="bench.flowed")(_ordered)

#: The flow part's control: stock Celery's ``rate_limit``, held by each worker alone.
#: Its calls go straight to the broker (the flow part's settings exclude it).
limited = app.task(name="bench.limited", rate_limit="20/s")(_ordered)

#: The flow keys' parts (``bench.flow_keys``): a flow of at most 2 running per key,
#: and a flow of a few queued per key (the fair share). ``bench.ordered`` with the
#: same ``flow_key=`` is their control: no flow covers it.
capped = app.task(name="bench.capped")(_ordered)
fair = app.task(name="bench.fair")(_ordered)

#: The Redis list of ``"<task id> <monotonic>"``, one per published message.
PUBLISHED_KEY = f"{env.QUEUE}:published"


def record_publishes() -> None:
    """Append each message the relay published (``message_published``) to Redis.

    The signal is sent once the batch's settlement committed: for a strict head,
    when it is published and held running. The strict part pairs these times with
    the end of the key's previous task: the hand-off.
    """
    from celery_outbox.signals import message_published

    def published(task_id: str = "", **_: Any) -> None:
        _runs().rpush(PUBLISHED_KEY, f"{task_id} {time.monotonic():.6f}")

    message_published.connect(published, weak=False, dispatch_uid="bench.published")


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
