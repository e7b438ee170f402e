"""The demo's only task: "send" a receipt, i.e. record that it ran."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from demo.celery import app

from .models import Receipt


@app.task(bind=True, name="demo.send_receipt")
def send_receipt(self: Any, order_id: int) -> None:
    """Record the execution: which task, for which order, when."""
    Receipt.objects.create(
        task_id=self.request.id, order_id=order_id, executed_at=timezone.now()
    )
