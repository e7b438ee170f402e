"""Tasks of the test project; each records its execution in the database."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from celery.exceptions import Reject
from django.db import transaction
from django.dispatch import receiver

from celery_outbox.inbox.signals import duplicate_skipped

from .models import TaskRun


def _record(task: Any, tag: str, value: Any = "", using: str = "default") -> None:
    TaskRun.objects.using(using).create(
        task_id=task.request.id or "",
        task_name=task.name,
        tag=str(tag),
        value=repr(value),
    )


@shared_task(bind=True, name="shop.record")
def record(self: Any, tag: str, value: Any = None) -> str:
    _record(self, tag, value)
    return str(tag)


@shared_task(bind=True, name="shop.add")
def add(self: Any, x: int, y: int, tag: str = "") -> int:
    _record(self, tag or f"add-{x}-{y}", x + y)
    return x + y


@shared_task(bind=True, name="shop.hold")
def hold(self: Any, tag: str, seconds: float = 0.0, retries: int = 0) -> str:
    """A run's interval: record ``start:<tag>`` (the worker process's pid), hold
    for ``seconds``, then record ``end:<tag>``. With ``retries``, each run but the
    last ends with ``self.retry(countdown=0)``; a run's tag then ends ``/<retry>``."""
    run = f"{tag}/{self.request.retries}" if retries else tag
    _record(self, f"start:{run}", os.getpid())
    time.sleep(seconds)
    _record(self, f"end:{run}")
    if self.request.retries < retries:
        raise self.retry(countdown=0)
    return tag


@shared_task(bind=True, name="shop.requeue_once", acks_late=True)
def requeue_once(self: Any, tag: str, seconds: float = 0.0) -> str:
    """A run's interval as ``shop.hold`` records it (``start:<tag>/<run>``,
    ``end:<tag>/<run>``); the first run then puts its message back in the queue
    (``Reject(requeue=True)``), and the second returns."""
    run = TaskRun.objects.filter(tag__startswith=f"start:{tag}/").count()
    _record(self, f"start:{tag}/{run}", os.getpid())
    time.sleep(seconds)
    _record(self, f"end:{tag}/{run}")
    if run == 0:
        raise Reject(f"{tag} requeued", requeue=True)
    return tag


@shared_task(bind=True, name="shop.collect")
def collect(self: Any, results: list[Any], tag: str) -> int:
    _record(self, tag, sorted(results))
    return len(results)


@shared_task(bind=True, name="shop.errback")
def errback(self: Any, task_id: str) -> str:
    """An errback of the old style (it takes the failed task's id): every Celery
    sends it as a task. Records ``errback:<failed task id>``."""
    _record(self, f"errback:{task_id}")
    return task_id


@shared_task(bind=True, name="shop.flaky", max_retries=3)
def flaky(self: Any, tag: str) -> str:
    _record(self, f"{tag}-attempt-{self.request.retries}")
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    _record(self, tag)
    return tag


@shared_task(bind=True, name="shop.at_eta")
def at_eta(self: Any, tag: str) -> str:
    """Record ``tag`` with the ETA the message carried (its ``eta`` header)."""
    _record(self, tag, self.request.eta)
    return tag


@shared_task(bind=True, name="shop.retry_later", max_retries=1)
def retry_later(self: Any, tag: str, countdown: float) -> str:
    """Run once, retry after ``countdown`` seconds, then record ``tag``."""
    _record(self, f"{tag}-attempt-{self.request.retries}")
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    _record(self, tag, self.request.eta)
    return tag


@shared_task(bind=True, name="shop.send_later")
def send_later(self: Any, tag: str, countdown: float, queue: str) -> str:
    """From a worker, outside a transaction: ``shop.record(tag)`` due in ``countdown``
    seconds, to ``queue``; returns its task id. Touches no database itself."""
    return str(record.apply_async((tag,), countdown=countdown, queue=queue).id)


@shared_task(bind=True, name="shop.spawn")
def spawn(self: Any, tag: str) -> str:
    """Enqueue a follow-up from inside the worker, outside any transaction."""
    record.delay(f"{tag}-child")
    _record(self, tag)
    return tag


@shared_task(bind=True, name="shop.trace")
def trace(self: Any, tag: str) -> str:
    """Record this execution's lineage: ``{"parent_id": ..., "root_id": ...}``."""
    _record(
        self,
        tag,
        {"parent_id": self.request.parent_id, "root_id": self.request.root_id},
    )
    return tag


@shared_task(bind=True, name="shop.spawn_child")
def spawn_child(self: Any, tag: str, atomic: bool = False) -> str:
    """Enqueue ``shop.trace(f"{tag}-child")`` from inside the worker.

    Outside a transaction the child goes straight to the broker; with ``atomic`` it is
    sent inside ``transaction.atomic()`` and so goes through the outbox, committed
    together with this task's own TaskRun row.
    """
    if not atomic:
        trace.delay(f"{tag}-child")
        _record(self, tag)
        return tag
    with transaction.atomic():
        trace.delay(f"{tag}-child")
        _record(self, tag)
    return tag


# Inbox tasks: their TaskRun row commits with the inbox row, so a duplicate delivery
# leaves no second row. A skipped delivery is recorded apart (DUPLICATE_TASK_NAME).

#: ``TaskRun.task_name`` of the row written for each delivery the inbox skipped.
DUPLICATE_TASK_NAME = "inbox.duplicate-skipped"


@receiver(duplicate_skipped)
def _record_skip(*, task_id: str, key: str, using: str, **_: Any) -> None:
    TaskRun.objects.using(using).create(
        task_id=task_id,
        task_name=DUPLICATE_TASK_NAME,
        tag=f"skip:{key}"[:255],
        value=repr(os.getpid()),
    )


@shared_task(bind=True, name="shop.inbox_record", inbox=True)
def inbox_record(self: Any, tag: str, value: Any = None, using: str = "default") -> str:
    _record(self, tag, value, using)
    return str(tag)


@shared_task(bind=True, name="shop.record_on")
def record_on(self: Any, tag: str, value: Any = None, using: str = "default") -> str:
    """``shop.inbox_record`` without the inbox, in a transaction of its own."""
    with transaction.atomic(using=using):
        _record(self, tag, value, using)
    return str(tag)


# Late acks, as teams that must not lose a task declare them: the message is
# acknowledged after the body ran, so a body that finished while the broker
# connection died is delivered again.


@shared_task(bind=True, name="shop.record_late", acks_late=True)
def record_late(self: Any, tag: str, seconds: float = 0.0) -> str:
    """Work for ``seconds``, then record ``tag``; acknowledged after it returns."""
    time.sleep(seconds)
    _record(self, tag, seconds)
    return str(tag)


@shared_task(bind=True, name="shop.inbox_record_late", acks_late=True, inbox=True)
def inbox_record_late(self: Any, tag: str, seconds: float = 0.0) -> str:
    """``shop.record_late`` through the inbox."""
    time.sleep(seconds)
    _record(self, tag, seconds)
    return str(tag)


@shared_task(bind=True, name="shop.inbox_slow", inbox=True)
def inbox_slow(self: Any, tag: str, seconds: float, using: str = "default") -> str:
    """Record, then hold the inbox transaction open for ``seconds``."""
    _record(self, tag, os.getpid(), using)
    time.sleep(seconds)
    return tag


class Flaky(Exception):
    """Raised by ``shop.inbox_flaky`` on its first two runs."""


@shared_task(
    bind=True,
    name="shop.inbox_flaky",
    inbox=True,
    autoretry_for=(Flaky,),
    max_retries=3,
    default_retry_delay=0.1,
)
def inbox_flaky(self: Any, tag: str) -> str:
    """Write an effect on every run, and fail the first two: only the third commits."""
    _record(self, tag, self.request.retries)
    if self.request.retries < 2:
        raise Flaky(f"run {self.request.retries}")
    return tag


@shared_task(bind=True, name="shop.ordered")
def ordered(self: Any, tag: str, seconds: float = 0.0, mode: str = "") -> str:
    """Sleep ``seconds``, then record ``tag``; ``mode`` ``hang`` (first run) or ``fail``.

    ``hang`` records the worker's pid under ``started:<tag>`` and sleeps long enough to
    be killed; a run after that does not hang again.
    """
    if mode == "hang" and not TaskRun.objects.filter(tag=f"started:{tag}").exists():
        _record(self, f"started:{tag}", os.getpid())
        time.sleep(60)
    if mode == "fail":
        raise ValueError(f"{tag} fails")
    time.sleep(seconds)
    _record(self, tag)
    return tag


@shared_task(bind=True, name="shop.ending")
def ending(self: Any, tag: str, how: str = "", seconds: float = 0.0) -> str:
    """Record ``started:<tag>`` (the worker process's pid), then end as ``how`` says.

    ``reject``: ``Reject(requeue=False)``; ``sleep``: sleep ``seconds`` (for a time
    limit, a terminate or a kill to end it) on its first start only; ``retry``:
    ``self.retry(countdown=seconds)`` on its first start only; ``replace``:
    replaced by ``shop.ordered`` recording ``<tag>:replacement`` after ``seconds``.
    Otherwise, or once its first run was cut short, it records ``<tag>``.
    """
    first = not TaskRun.objects.filter(tag=f"started:{tag}").exists()
    _record(self, f"started:{tag}", os.getpid())
    if how == "reject":
        raise Reject(f"{tag} refused", requeue=False)
    if how == "sleep" and first:
        time.sleep(seconds)
    if how == "retry" and first:
        raise self.retry(countdown=seconds)
    if how == "replace":
        return self.replace(ordered.si(f"{tag}:replacement", seconds))  # type: ignore[no-any-return]
    _record(self, tag)
    return tag
