"""How the commands report an error of ours: a ``CommandError`` (exit 1) saying the fix."""

from __future__ import annotations

from django.core.management.base import CommandError

from ..conf import get_settings
from ..exceptions import OutboxDatabaseError, OutboxError


def command_error(exc: OutboxError) -> CommandError:
    """``exc`` as the command's error; an unreachable database also names its alias."""
    if not isinstance(exc, OutboxDatabaseError):
        return CommandError(str(exc))
    from ..store import outbox_alias

    alias = outbox_alias(get_settings())
    return CommandError(
        f"{exc}\nCheck that the outbox database runs and that DATABASES[{alias!r}] "
        f"points at it (the outbox alias: CELERY_OUTBOX_DATABASE, else the router's "
        f"choice for the outbox models)."
    )
