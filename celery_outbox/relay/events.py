"""Deprecated: the relay's observations live in :mod:`celery_outbox.relay.observations`.

"Event" is the word of :mod:`celery_outbox.events` (the published fan-out); the
loop's reports to its observers are observations. Kept for one release.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

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

warnings.warn(
    "celery_outbox.relay.events is deprecated and goes in the next release: import "
    "from celery_outbox.relay.observations (RelayEvent is RelayObservation, Listener "
    "is Observer, log_event is log_observation, emit is "
    "celery_outbox.engine.observations.notify).",
    DeprecationWarning,
    stacklevel=2,
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
