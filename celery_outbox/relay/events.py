"""Deprecated: the relay's observations live in :mod:`celery_outbox.relay.observations`.

"Event" is the word of :mod:`celery_outbox.events` (the published fan-out); the
loop's reports to its observers are observations. Kept for one release.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..deprecation import deprecated
from ..engine.observations import notify
from .observations import (
    BatchHook,
    BatchSettled,
    BreakerOpened,
    Coalesced,
    Idle,
    LoopError,
    Observer,
    RelayObservation,
    StopReason,
    TracingHook,
    guarded,
    log_observation,
)

deprecated(
    "celery_outbox.relay.events",
    "celery_outbox.relay.observations",
    note="RelayEvent is RelayObservation, Listener is Observer, log_event is "
    "log_observation, emit is celery_outbox.engine.observations.notify.",
)

RelayEvent = RelayObservation
Listener = Observer
log_event = log_observation


def emit(listeners: Sequence[Observer], event: RelayObservation) -> None:
    """Deprecated: :func:`celery_outbox.engine.observations.notify`."""
    notify(listeners, event)


__all__ = [
    "BatchHook",
    "BatchSettled",
    "BreakerOpened",
    "Coalesced",
    "Idle",
    "Listener",
    "LoopError",
    "RelayEvent",
    "StopReason",
    "TracingHook",
    "emit",
    "guarded",
    "log_event",
]
