"""The firing service (the relay's app in the subprocesses)."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.events_project.settings")

from celery_outbox import OutboxCelery
from tests.events_project.catalog import declare_events

app = OutboxCelery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
order_created = declare_events(app)
