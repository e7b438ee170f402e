"""Django system checks, with stable ids (``celery_outbox.E00x`` / ``W00x``)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from django.db import connections

from .conf import get_settings
from .exceptions import OutboxConfigurationError


@register("celery_outbox")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Settings parse, and the outbox database can run a relay."""
    try:
        settings = get_settings()
    except OutboxConfigurationError as exc:
        return [Error(str(exc), id="celery_outbox.E001")]
    from .enqueue import outbox_alias

    alias = outbox_alias(settings)
    if alias not in connections:
        return [
            Error(
                f"CELERY_OUTBOX_DATABASE = {alias!r} is not in DATABASES.",
                hint="Name an alias from DATABASES.",
                id="celery_outbox.E002",
            )
        ]
    connection = connections[alias]
    messages: list[CheckMessage] = []
    if connection.vendor == "sqlite":
        messages.append(
            Warning(
                f"The outbox database {alias!r} is SQLite: run exactly one relay.",
                hint="Use PostgreSQL or MySQL/MariaDB to run several relays.",
                id="celery_outbox.W001",
            )
        )
    elif connection.vendor not in {"postgresql", "mysql"}:
        messages.append(
            Error(
                f"The outbox database {alias!r} uses {connection.vendor!r}, which celery-outbox "
                "does not support.",
                hint="Use PostgreSQL, MySQL 8 / MariaDB >= 10.6 or SQLite.",
                id="celery_outbox.E003",
            )
        )
    if not settings.confirm_publish:
        messages.append(
            Warning(
                "CELERY_OUTBOX_CONFIRM_PUBLISH is False: rows are deleted without the "
                "broker confirming the publish, so a broker crash can lose tasks.",
                hint="Leave publisher confirms on unless you measured you cannot afford them.",
                id="celery_outbox.W002",
            )
        )
    return messages
