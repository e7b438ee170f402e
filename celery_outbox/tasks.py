"""Celery tasks shipped with celery-outbox.

``celery_outbox.purge_dead_letters`` applies ``CELERY_OUTBOX_DEAD_LETTER_RETENTION``
and ``CELERY_OUTBOX_HISTORY_RETENTION``.
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
from .store import outbox_stores

logger = logging.getLogger("celery_outbox")


@shared_task(name="celery_outbox.purge_dead_letters", ignore_result=True)
def purge_dead_letters() -> dict[str, Any]:
    """Delete dead letters older than ``CELERY_OUTBOX_DEAD_LETTER_RETENTION``.

    Keeps dead letters when the setting is unset. Returns ``{"deleted": n,
    "retention_seconds": s}`` (``s`` is None when unset). History events older than
    ``CELERY_OUTBOX_HISTORY_RETENTION`` are deleted too, in chunks, whether history
    is on or not (events left from when it was on still expire); with history on,
    or when any was deleted, the result also has ``"history_deleted": n``.
    """
    settings = get_settings()
    stores = outbox_stores(settings)
    result: dict[str, Any] = {"deleted": 0, "retention_seconds": None}
    retention = settings.dead_letter_retention
    if retention is None:
        logger.info(
            "CELERY_OUTBOX_DEAD_LETTER_RETENTION is not set: dead letters are kept"
        )
    else:
        report = stores.operator().purge_dead_letters(retention)
        if report.deleted:
            logger.info(
                "purged %d dead letters older than %.0f s", report.deleted, retention
            )
        result = {"deleted": report.deleted, "retention_seconds": retention}
    events = stores.history_log().purge_history(settings.history_retention)
    if events:
        logger.info(
            "purged %d history events older than %.0f s",
            events,
            settings.history_retention,
        )
    if events or settings.history:
        result["history_deleted"] = events
    return result


@shared_task(name="celery_outbox.purge_dedup_keys", ignore_result=True)
def purge_dedup_keys() -> dict[str, Any]:
    """Delete ``dedup_key`` holds that have ended (task published, window over).

    Schedule it with beat like ``purge_dead_letters`` when you use ``dedup_key``.
    Returns ``{"deleted": n}``.
    """
    deleted = outbox_stores().dedup().purge_dedup_keys()
    if deleted:
        logger.info("purged %d ended dedup keys", deleted)
    return {"deleted": deleted}
