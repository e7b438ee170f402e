"""Django app configuration."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryOutboxConfig(AppConfig):
    """The ``celery_outbox`` Django app: models, admin, checks, the ``outbox`` command."""

    name = "celery_outbox"
    verbose_name = "Celery outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .conf import get_settings
        from .enqueue import WRITTEN
        from .flow.worker import watch
        from .signals import send_created

        # message_created: the Django signal hears of every row the enqueue path
        # and a held event retry write, in the writer's transaction.
        if send_created not in WRITTEN:
            WRITTEN.append(send_created)
        # Every process that loads Django (web, worker, relay, commands) refuses
        # wrong CELERY_OUTBOX_* settings now, all of them in one message, instead
        # of at its first enqueue.
        get_settings()
        # A worker whose app is a plain Celery() never connects the flow's reports;
        # Django's start is the one place its process surely passes through.
        watch()
