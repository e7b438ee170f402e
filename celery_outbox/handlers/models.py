"""The handler app's models, defined beside their store in
:mod:`celery_outbox.store.handlers.models`; Django finds them here."""

from __future__ import annotations

from ..store.handlers.models import (
    HandlerCounter,
    HandlerDeadLetter,
    HandlerMessage,
    HandlerPause,
    HandlerProcessor,
    HandlerShard,
)

__all__ = [
    "HandlerCounter",
    "HandlerDeadLetter",
    "HandlerMessage",
    "HandlerPause",
    "HandlerProcessor",
    "HandlerShard",
]
