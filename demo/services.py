"""The two services that receive the demo's events: billing and shipping.

Each is its own Celery app with its own name (its queues are named after it) and
runs in its own worker: ``celery -A demo.billing worker``, ``celery -A demo.shipping
worker``. Only on RabbitMQ or Redis: the embedded broker cannot route events.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")

from celery_outbox import OutboxCelery
from demo.config import announce_when_ready

#: The event the demo fires, and the pattern both services handle.
ORDER_PLACED = "demo.order.placed"


def service(name: str) -> OutboxCelery:
    """The app of service ``name``, whose subscriber records each event it got."""
    app = OutboxCelery(f"demo-{name}")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    announce_when_ready(app)

    @app.subscriber("demo.order.*")
    def on_order(order_number: str, **_: Any) -> None:
        from django.utils import timezone

        from demo.shop.models import Run

        Run.objects.create(
            lane=f"event:{name}", key=order_number, executed_at=timezone.now()
        )

    return app
