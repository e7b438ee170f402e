"""The inbox's purge task, for Celery beat.

``celery_outbox.inbox.purge`` deletes inbox rows older than
``CELERY_OUTBOX_INBOX_RETENTION`` (7 days by default), in chunks::

    CELERY_BEAT_SCHEDULE = {
        "celery-outbox-inbox-purge": {
            "task": "celery_outbox.inbox.purge",
            "schedule": 3600.0,
        },
    }
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.contrib.django.task import DjangoTask

from ..conf import get_settings
from .store import PURGE_CHUNK, InboxStore
from .task import inbox_alias

logger = logging.getLogger("celery_outbox.inbox")


# Celery's DjangoTask without the inbox's part: the purge keeps no inbox row of its
# own (it was OutboxTask with inbox=False, whose ordering part it never used).
@shared_task(name="celery_outbox.inbox.purge", ignore_result=True, base=DjangoTask)
def purge(chunk: int = PURGE_CHUNK) -> dict[str, Any]:
    """Delete inbox rows older than the retention; returns ``{"deleted", "retention_seconds"}``."""
    settings = get_settings()
    deleted = InboxStore(inbox_alias(settings)).purge(settings.inbox_retention, chunk)
    if deleted:
        logger.info(
            "purged %d inbox rows older than %.0f s", deleted, settings.inbox_retention
        )
    return {"deleted": deleted, "retention_seconds": settings.inbox_retention}
