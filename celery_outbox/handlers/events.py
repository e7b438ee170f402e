"""Deprecated: the processor's observations live in :mod:`.observations`.

"Event" is the word of :mod:`celery_outbox.events` (the published fan-out), and
``emit`` is the handler outbox's public call; the processor's reports to its
observers are observations, handed out by
:func:`celery_outbox.engine.observations.notify`. Kept for one release.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from ..deprecation import deprecated
from ..engine.observations import notify
from .observations import (
    HandlerObservation,
    HandlerObserver,
    MessageHandled,
    MessagesCoalesced,
    PassDone,
)

deprecated(
    "celery_outbox.handlers.events",
    "celery_outbox.handlers.observations",
    note="HandlerEvent is HandlerObservation, HandlerListener is HandlerObserver; "
    "MessageHandled.action is a celery_outbox.outcomes.Action: DELETE for done.",
)

HandlerEvent = HandlerObservation
HandlerListener = HandlerObserver


class Outcome(str, enum.Enum):
    """Deprecated: :class:`celery_outbox.outcomes.Action` (DELETE, RETRY, DEAD_LETTER)."""

    DONE = "done"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"


def emit(listeners: Sequence[HandlerObserver], event: HandlerObservation) -> None:
    """Deprecated: :func:`celery_outbox.engine.observations.notify`."""
    notify(listeners, event)


__all__ = [
    "HandlerEvent",
    "HandlerListener",
    "MessageHandled",
    "MessagesCoalesced",
    "Outcome",
    "PassDone",
    "emit",
]
