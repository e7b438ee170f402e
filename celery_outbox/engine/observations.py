"""What the loop of any lane tells its observers, and how it tells them.

An *observation* is a frozen value the loop hands to every observer (logging,
metrics, tracing, Django signals subscribe this way); :func:`notify` is the fan-out.
The word "event" is kept for the published fan-out product of
:mod:`celery_outbox.events`; a handler outbox's public call is ``emit``.
Each lane adds observations of its own (:mod:`celery_outbox.relay.observations`,
:mod:`celery_outbox.handlers.observations`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("celery_outbox.engine")


class StopReason(enum.Enum):
    """Why a loop's ``run`` returned."""

    #: :meth:`~celery_outbox.engine.loop.Loop.stop` was called (SIGTERM, SIGINT).
    SIGNAL = "signal"
    #: Run with ``until_empty`` and nothing was due.
    EMPTY = "empty"
    #: Run with ``until_empty``, and work the lane could do is left undone (rows a
    #: broker outage deferred, a database that did not answer): the lane's
    #: ``left()`` says what.
    UNFINISHED = "unfinished"
    #: Run with ``until_empty``, and all the work left is held back by a limit (a
    #: flow's rate, a key at its limit, an ordered key's head): ``left()`` says what.
    HELD = "held"


@dataclass(frozen=True)
class LoopError:
    """A stage of the loop failed (the database went away); the loop goes on."""

    stage: str
    error: str


@dataclass(frozen=True)
class Idle:
    """A turn of the loop found nothing to do (or was paused); it waits next."""

    seconds: float


#: Anything that takes observations; it ignores the kinds it does not know.
Observer = Callable[[Any], None]


def notify(
    observers: Sequence[Callable[[Any], None]],
    observation: object,
    log: logging.Logger = logger,
) -> None:
    """Hand ``observation`` to every observer; one that raises is logged and skipped."""
    for observer in observers:
        try:
            observer(observation)
        except Exception:
            log.exception("observer %r failed", observer)
