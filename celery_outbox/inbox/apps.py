"""Django app configuration of the inbox."""

from __future__ import annotations

from django.apps import AppConfig


class InboxConfig(AppConfig):
    """``celery_outbox.inbox``: the table of messages a worker has already run.

    Its checks (:mod:`.checks`) are registered by :mod:`celery_outbox.checks`.
    """

    name = "celery_outbox.inbox"
    label = "celery_outbox_inbox"
    verbose_name = "Celery outbox: inbox"
    default_auto_field = "django.db.models.BigAutoField"
