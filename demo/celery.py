"""The demo's Celery app: an OutboxCelery configured from Django settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo.settings")

from celery.signals import worker_ready

from celery_outbox import OutboxCelery

app = OutboxCelery("demo")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["demo.shop"])

#: Touched by the worker once it consumes; the driver waits for it.
READY_FILE = "worker.ready"


@worker_ready.connect
def _announce_ready(**_: Any) -> None:
    from django.conf import settings

    Path(settings.VAR_DIR, READY_FILE).touch()
