"""The demo's Celery app: an OutboxCelery configured from Django settings."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")

from celery_outbox import OutboxCelery
from demo.config import announce_when_ready

app = OutboxCelery("demo")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["demo.shop"])
announce_when_ready(app)
