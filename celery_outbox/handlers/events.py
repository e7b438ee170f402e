"""What the handler processor reports. Metrics (:mod:`.metrics`) subscribe to these.

The processor calls each listener with every event; a listener that raises is logged
and skipped, never stops the processor.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger("celery_outbox.handlers")


class Outcome(str, enum.Enum):
    """What became of one message after its receiver ran."""

    DONE = "done"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class MessageHandled:
    """A receiver ran for one message and its outcome is committed."""

    database: str
    shard: str
    category: str
    outcome: Outcome
    #: 1 on the message's first run.
    attempt: int
    #: The receiver's run and the settlement.
    seconds: float
    #: From the message's write to its settlement (database clock at the read, then
    #: the processor's monotonic clock); None when the read did not measure it.
    age_seconds: float | None


@dataclass(frozen=True)
class MessagesCoalesced:
    """Messages deleted unrun because a newer one of their object waits in the shard."""

    database: str
    shard: str
    #: Per category, how many.
    counts: Mapping[str, int]


@dataclass(frozen=True)
class PassDone:
    """One pass over every database ended; ``claimed`` shards were processed."""

    claimed: int


HandlerEvent = MessageHandled | MessagesCoalesced | PassDone
HandlerListener = Callable[[HandlerEvent], None]


def emit(listeners: Sequence[HandlerListener], event: HandlerEvent) -> None:
    """Give ``event`` to every listener; one that raises is logged and skipped."""
    for listener in listeners:
        try:
            listener(event)
        except Exception:
            logger.exception("handler event listener %r failed", listener)
