"""Django app configuration of the handler outboxes."""

from __future__ import annotations

from django.apps import AppConfig


class HandlersConfig(AppConfig):
    """``celery_outbox.handlers``: ordered, coalesced outboxes run by receivers in-process."""

    name = "celery_outbox.handlers"
    label = "celery_outbox_handlers"
    verbose_name = "Celery outbox: handler outboxes"
    default_auto_field = "django.db.models.BigAutoField"
