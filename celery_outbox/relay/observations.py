"""What the relay lane tells its observers: logging, metrics, tracing and signals.

The observations every lane shares (:class:`LoopError`, :class:`Idle`,
:class:`StopReason`) come from :mod:`celery_outbox.engine.observations`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.observations import OBSERVER_FAILURES, Idle, LoopError, StopReason
from ..envelope import StoredMessage
from ..outcomes import PublishResult, Settlement
from ..store import SettleReport
from ..store.ordering import CoalescedRow

logger = logging.getLogger("celery_outbox.relay")


@dataclass(frozen=True)
class BatchSettled:
    """A batch was claimed, published and settled (the settlement is committed)."""

    messages: tuple[StoredMessage, ...]
    results: tuple[PublishResult, ...]
    settlement: Settlement
    report: SettleReport
    #: Claim to settled, and the publish alone.
    seconds: float
    publish_seconds: float

    @property
    def claimed(self) -> int:
        """How many rows the batch held."""
        return len(self.messages)


@dataclass(frozen=True)
class BreakerOpened:
    """Consecutive broker outages: claiming pauses."""

    seconds: float
    #: The last outage's reason, as the publisher gave it.
    error: str = ""


@dataclass(frozen=True)
class Coalesced:
    """A claim deleted unpublished rows that a newer row of their group replaces."""

    rows: tuple[CoalescedRow, ...]


RelayObservation = BatchSettled | LoopError | BreakerOpened | Idle | Coalesced
#: A relay observer: called with each :data:`RelayObservation`.
Observer = Callable[[RelayObservation], None]


class BatchHook(Protocol):
    """Wraps the publishing and settling of each batch (a tracing span, for instance).

    The batch's :class:`BatchSettled` event is delivered inside the block, so a hook that
    is also a listener can annotate what it opened.
    """

    def batch(self, messages: Sequence[StoredMessage]) -> AbstractContextManager[Any]:
        """The context manager entered around one batch."""
        ...


class TracingHook(BatchHook, Protocol):
    """A batch hook that also listens to the observations of the batch it wraps."""

    def __call__(self, event: RelayObservation) -> None:
        """Receive one relay observation."""
        ...


def log_observation(event: RelayObservation) -> None:
    """The default observer: one log line per event worth a line."""
    if isinstance(event, BatchSettled):
        report = event.report
        logger.info(
            "batch: %d claimed, %d published, %d retried, %d dead-lettered, %d released "
            "in %.1f ms",
            event.claimed,
            report.deleted + report.held,
            report.retried,
            report.dead_lettered,
            report.released,
            event.seconds * 1000,
        )
    elif isinstance(event, LoopError):
        logger.error("relay %s failed: %s", event.stage, event.error)
    elif isinstance(event, BreakerOpened):
        logger.warning(
            "broker unreachable: pausing for %.1f s: %s",
            event.seconds,
            event.error or "no reason given",
        )
    elif isinstance(event, Coalesced):
        logger.info("coalesced: %d older rows dropped for newer ones", len(event.rows))


@contextlib.contextmanager
def guarded(hook: BatchHook, messages: Sequence[StoredMessage]) -> Iterator[None]:
    """Enter a batch hook; a hook that fails never stops the loop (:data:`OBSERVER_FAILURES`
    logs it once per kind and counts the rest)."""
    try:
        manager = hook.batch(messages)
        manager.__enter__()
    except Exception as exc:
        OBSERVER_FAILURES.failed(hook, exc, logger)
        yield
        return
    try:
        yield
    except BaseException as exc:
        try:
            manager.__exit__(type(exc), exc, exc.__traceback__)
        except Exception as failure:
            OBSERVER_FAILURES.failed(hook, failure, logger)
        raise
    try:
        manager.__exit__(None, None, None)
    except Exception as exc:
        OBSERVER_FAILURES.failed(hook, exc, logger)


__all__ = [
    "BatchHook",
    "BatchSettled",
    "BreakerOpened",
    "Coalesced",
    "Idle",
    "LoopError",
    "Observer",
    "RelayObservation",
    "StopReason",
    "TracingHook",
    "guarded",
    "log_observation",
]
