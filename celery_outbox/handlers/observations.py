"""What the handler processor tells its observers. Metrics (:mod:`.metrics`) subscribe.

The processor's loop is the engine's (:mod:`celery_outbox.engine.loop`), so its
observers also get the engine's :class:`~celery_outbox.engine.observations.Idle`
and :class:`~celery_outbox.engine.observations.LoopError`; an observer ignores the
kinds it does not know. A message's fate is spelled in the one decision vocabulary,
:class:`celery_outbox.outcomes.Action`: ``DELETE`` (its receiver succeeded),
``RETRY`` or ``DEAD_LETTER``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..engine.observations import Idle, LoopError
from ..outcomes import Action


@dataclass(frozen=True)
class MessageHandled:
    """A receiver ran for one message and its fate is committed."""

    database: str
    shard: str
    category: str
    #: ``Action.DELETE`` (done), ``Action.RETRY`` or ``Action.DEAD_LETTER``.
    action: Action
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


HandlerObservation = MessageHandled | MessagesCoalesced | PassDone | Idle | LoopError
#: A processor observer: called with each :data:`HandlerObservation`.
HandlerObserver = Callable[[HandlerObservation], None]
