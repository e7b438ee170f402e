"""Which alias holds the outbox during the benchmark: switched between rounds.

The enqueue part compares Django's stock backend (``default``) with the
write-on-commit engine (``commit``, the same database). Switching through a router
changes no setting, so the variants can take turns in short rounds without every
switch making Celery and celery-outbox read their configuration again.
"""

from __future__ import annotations

from typing import Any

_OUTBOX_MODELS = frozenset({"outboxmessage", "deadletter"})


class OutboxRouter:
    """Sends the outbox models to :attr:`alias`; everything else is left to Django."""

    alias = "default"

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        if model._meta.app_label == "celery_outbox" and (
            model._meta.model_name in _OUTBOX_MODELS
        ):
            return self.alias
        return None

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.db_for_write(model, **hints)

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return db == "default"  # "commit" is the same database
