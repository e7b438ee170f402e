"""Tasks of the test project; each records its execution in the database."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.db import transaction

from .models import TaskRun


def _record(task: Any, tag: str, value: Any = "") -> None:
    TaskRun.objects.create(
        task_id=task.request.id, task_name=task.name, tag=str(tag), value=repr(value)
    )


@shared_task(bind=True, name="shop.record")
def record(self: Any, tag: str, value: Any = None) -> str:
    _record(self, tag, value)
    return str(tag)


@shared_task(bind=True, name="shop.add")
def add(self: Any, x: int, y: int, tag: str = "") -> int:
    _record(self, tag or f"add-{x}-{y}", x + y)
    return x + y


@shared_task(bind=True, name="shop.collect")
def collect(self: Any, results: list[Any], tag: str) -> int:
    _record(self, tag, sorted(results))
    return len(results)


@shared_task(bind=True, name="shop.flaky", max_retries=3)
def flaky(self: Any, tag: str) -> str:
    _record(self, f"{tag}-attempt-{self.request.retries}")
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    _record(self, tag)
    return tag


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
