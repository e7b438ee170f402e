"""The demo's tasks: each records that it ran, so the driver counts runs, not sends."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver
from django.utils import timezone

from celery_outbox.inbox.signals import duplicate_skipped
from celery_outbox.models import OutboxMessage
from demo.celery import app

from .models import Receipt, Run


@app.task(bind=True, name="demo.send_receipt")
def send_receipt(self: Any, order_id: int) -> None:
    """Record the execution: which task, for which order, when."""
    Receipt.objects.create(
        task_id=self.request.id, order_id=order_id, executed_at=timezone.now()
    )


def parcel_key(parcel: str) -> str:
    """The ordering key of a parcel's steps."""
    return f"parcel:{parcel}"


@app.task(bind=True, name="demo.pack_step")
def pack_step(self: Any, parcel: str, step: int) -> None:
    """One step of packing a parcel; sent with ``ordering="strict"`` per parcel.

    It also records how many rows of its key are still in the outbox: with strict
    order, the later steps wait there until this one has finished.
    """
    waiting = OutboxMessage.objects.filter(ordering_key=parcel_key(parcel)).count()
    behind = waiting - 1  # this step's own row stays in the outbox until it finished
    Run.objects.create(
        lane="strict", key=parcel, seq=step, behind=behind, executed_at=timezone.now()
    )


@app.task(bind=True, name="demo.credit_points", inbox=True)
def credit_points(self: Any, order_number: str) -> None:
    """Loyalty points for an order: runs once per message, however often delivered."""
    Run.objects.create(lane="inbox", key=self.request.id, executed_at=timezone.now())


@receiver(duplicate_skipped)
def _count_duplicate(task_id: str, **_: Any) -> None:
    """The inbox acknowledged a second delivery without running the body: note it."""
    Run.objects.create(lane="inbox-skipped", key=task_id, executed_at=timezone.now())
