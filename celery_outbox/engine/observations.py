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
import threading
from collections import Counter
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


class ObserverFailures:
    """Observers and hooks that raised: each kind logged once, then counted.

    A kind is the observer's class and the exception's class. Its first failure is
    logged with the traceback; the later ones are counted, and the count is logged
    (without a traceback) when it reaches 10, 100, 1,000 and so on. An observer that
    fails on every batch (a tracing library whose API changed under it) therefore
    writes a handful of lines a day, never a traceback per batch.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def failed(self, what: object, error: BaseException, log: logging.Logger) -> None:
        """Count ``what``'s failure with ``error``; log it if it is due."""
        kind = (type(what).__qualname__, type(error).__qualname__)
        with self._lock:
            self.counts[kind] += 1
            count = self.counts[kind]
        if count == 1:
            log.error(
                "%r failed; its later failures with %s are counted, not logged",
                what,
                kind[1],
                exc_info=error,
            )
        elif _power_of_ten(count):
            log.error("%r has failed %d times with %s: %s", what, count, kind[1], error)


def _power_of_ten(count: int) -> bool:
    while count % 10 == 0:
        count //= 10
    return count == 1


#: Every loop's observers and batch hooks, in this process.
OBSERVER_FAILURES = ObserverFailures()


def notify(
    observers: Sequence[Callable[[Any], None]],
    observation: object,
    log: logging.Logger = logger,
) -> None:
    """Hand ``observation`` to every observer; one that raises is skipped
    (:data:`OBSERVER_FAILURES` logs it once per kind and counts the rest)."""
    for observer in observers:
        try:
            observer(observation)
        except Exception as exc:
            OBSERVER_FAILURES.failed(observer, exc, log)
