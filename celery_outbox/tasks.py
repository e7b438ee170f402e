"""Celery tasks shipped with celery-outbox.

``celery_outbox.purge_dead_letters`` applies ``CELERY_OUTBOX_DEAD_LETTER_RETENTION``.
Schedule it with Celery beat, for example once an hour::

    # settings.py
    CELERY_OUTBOX_DEAD_LETTER_RETENTION = "30d"
    CELERY_BEAT_SCHEDULE = {
        "celery-outbox-purge-dead-letters": {
            "task": "celery_outbox.purge_dead_letters",
            "schedule": 3600.0,
        },
    }

and make sure the worker imports this module (``app.autodiscover_tasks()`` finds it
because ``celery_outbox`` is in ``INSTALLED_APPS``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from .conf import get_settings
from .enqueue import outbox_alias
from .store import OutboxStore

logger = logging.getLogger("celery_outbox")


@shared_task(name="celery_outbox.purge_dead_letters", ignore_result=True)
def purge_dead_letters() -> dict[str, Any]:
    """Delete dead letters older than ``CELERY_OUTBOX_DEAD_LETTER_RETENTION``.

    Does nothing when the setting is unset (dead letters are kept forever). Returns
    ``{"deleted": n, "retention_seconds": s}`` (``s`` is None when unset).
    """
    settings = get_settings()
    retention = settings.dead_letter_retention
    if retention is None:
        logger.info(
            "CELERY_OUTBOX_DEAD_LETTER_RETENTION is not set: dead letters are kept"
        )
        return {"deleted": 0, "retention_seconds": None}
    report = OutboxStore(outbox_alias(settings)).purge_dead_letters(retention)
    if report.deleted:
        logger.info(
            "purged %d dead letters older than %.0f s", report.deleted, retention
        )
    return {"deleted": report.deleted, "retention_seconds": retention}


@shared_task(name="celery_outbox.purge_dedup_keys", ignore_result=True)
def purge_dedup_keys() -> dict[str, Any]:
    """Delete ``dedup_key`` holds that have ended (task published, window over).

    Schedule it with beat like ``purge_dead_letters`` when you use ``dedup_key``.
    Returns ``{"deleted": n}``.
    """
    deleted = OutboxStore(outbox_alias(get_settings())).purge_dedup_keys()
    if deleted:
        logger.info("purged %d ended dedup keys", deleted)
    return {"deleted": deleted}
