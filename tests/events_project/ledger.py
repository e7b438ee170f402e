"""The ledger service: its subscriber runs through the inbox (once per event)."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.events_project.settings")

from celery_outbox import OutboxCelery
from tests.events_project.record import fail_now, record

app = OutboxCelery("ledger")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.subscriber("order.*", inbox=True)
def on_order(order_id: int, *rest: object, **more: object) -> None:
    from tests.project.shop.models import TaskRun

    record("ledger", "order", order_id, phase="start")
    # The effect: committed with the inbox row, or rolled back with it.
    TaskRun.objects.create(task_id=str(order_id), task_name="ledger", tag="ledger")
    if fail_now("ledger"):
        raise RuntimeError("failing on purpose")
    record("ledger", "order", order_id, phase="done")
