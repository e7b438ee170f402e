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
from django.apps import apps

from .conf import OutboxSettings, get_settings
from .engine.deadletters import expire
from .store import outbox_stores

logger = logging.getLogger("celery_outbox")


@shared_task(name="celery_outbox.purge_dead_letters", ignore_result=True)
def purge_dead_letters() -> dict[str, Any]:
    """Delete dead letters older than ``CELERY_OUTBOX_DEAD_LETTER_RETENTION``.

    Keeps dead letters when the setting is unset. Returns ``{"deleted": n,
    "retention_seconds": s}`` (``s`` is None when unset); with the handler outboxes
    installed, their dead letters expire by the same setting, counted in
    ``"handler_deleted"``. History events older than
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
        operator = stores.operator()
        deleted = expire(
            lambda seconds: operator.purge_dead_letters(seconds).deleted, retention
        )
        result = {"deleted": deleted, "retention_seconds": retention}
        if apps.is_installed("celery_outbox.handlers"):
            result["handler_deleted"] = _purge_handler_dead_letters(settings, retention)
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


def _purge_handler_dead_letters(settings: OutboxSettings, retention: float) -> int:
    from .handlers.processor import default_databases
    from .store.handlers.sql import HandlerStore

    return sum(
        expire(
            HandlerStore(alias).purge_dead_letters, retention, "handler dead letters"
        )
        for alias in default_databases(settings)
    )


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
