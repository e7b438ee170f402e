"""The shipping service: its own app (own name, own queues)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.events_project.settings")

from celery_outbox import OutboxCelery
from tests.events_project.record import flag, record

app = OutboxCelery("shipping")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.subscriber("order.*")
def on_order(order_id: int, *rest: object, **more: object) -> None:
    record("shipping", "order", order_id, phase="start")
    if flag("shipping", "slow"):
        time.sleep(30)
    if flag("shipping", "fail"):
        raise RuntimeError("failing on purpose")
    record("shipping", "order", order_id, phase="done")
