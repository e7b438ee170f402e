"""The values the relay, the store and the publishers pass each other.

A bottom module: it imports nothing of the package, so the store and the
publishers need not import the relay to speak of outcomes and decisions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Outcome(enum.Enum):
    """What happened when the relay tried to publish one message."""

    PUBLISHED = "published"  # the broker confirmed it
    FAILED = "failed"  # the broker refused this message: counts as an attempt
    OUTAGE = "outage"  # the broker could not be reached: not the message's fault
    NOT_SENT = "not_sent"  # never tried (shutdown, batch cut short)


@dataclass(frozen=True)
class PublishResult:
    """The outcome of one message, with the reason when it was not published."""

    message_id: int
    outcome: Outcome
    error: str = ""
    #: For an ``OUTAGE``: the message was written to a connection that then broke
    #: before the broker confirmed it. A message whose send kills the connection
    #: every time looks like this; a wrong password or a resource alarm never does.
    in_flight: bool = False


class Action(enum.Enum):
    """What the relay does with a claimed row after publishing."""

    DELETE = "delete"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    RELEASE = "release"
    #: A strict head was published: it stays, running, until its worker reports.
    HOLD = "hold"
    #: A head failed for good under the ``block`` policy: its key waits for an operator.
    BLOCK = "block"


@dataclass(frozen=True)
class Decision:
    """The fate of one row: an action, the delay before it is due again, the reason."""

    message_id: int
    action: Action
    delay: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Settlement:
    """All decisions of one batch, grouped by action so each kind is one statement."""

    delete: tuple[int, ...] = ()
    retry: tuple[Decision, ...] = ()
    dead_letter: tuple[Decision, ...] = ()
    release: tuple[Decision, ...] = ()
    #: Published strict heads (:mod:`celery_outbox.ordering`).
    hold: tuple[Decision, ...] = ()
    block: tuple[Decision, ...] = ()

    @classmethod
    def of(cls, decisions: Iterable[Decision]) -> Settlement:
        """Group decisions by action."""
        grouped: dict[Action, list[Decision]] = {action: [] for action in Action}
        for decision in decisions:
            grouped[decision.action].append(decision)
        return cls(
            delete=tuple(d.message_id for d in grouped[Action.DELETE]),
            retry=tuple(grouped[Action.RETRY]),
            dead_letter=tuple(grouped[Action.DEAD_LETTER]),
            release=tuple(grouped[Action.RELEASE]),
            hold=tuple(grouped[Action.HOLD]),
            block=tuple(grouped[Action.BLOCK]),
        )

    @property
    def size(self) -> int:
        """How many rows this settlement touches."""
        return (
            len(self.delete)
            + len(self.retry)
            + len(self.dead_letter)
            + len(self.release)
            + len(self.hold)
            + len(self.block)
        )
