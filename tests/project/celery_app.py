"""The test project's Celery app: an OutboxCelery configured from Django settings."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.project.settings")

from celery_outbox import OutboxCelery

app = OutboxCelery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tests.project.shop"])
