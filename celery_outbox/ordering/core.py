"""Ordering decisions, as pure functions over values (no database, no broker).

* :func:`ordered_settlement`: what becomes of a batch's keyed rows after publishing
  (a strict head is held, a failed head of a ``block`` key is blocked);
* :func:`report_for`: how a worker settles a strict head for each way its task ended.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from ..engine.endings import Ending
from ..envelope import StoredMessage
from ..ordering_options import UNORDERED, Ordering, Policy
from ..outcomes import Action, Decision, Settlement


def ordering_of(message: StoredMessage) -> Ordering:
    """The ordering a claimed message was enqueued with."""
    envelope = message.envelope
    if envelope.ordering_key is None:
        return UNORDERED
    return Ordering.read(envelope.ordering_key, envelope.headers)


def ordered_settlement(
    settlement: Settlement, messages: Sequence[StoredMessage], running_seconds: float
) -> Settlement:
    """``settlement`` with the keyed rows' ordering applied.

    A published strict head is held for ``running_seconds`` (it stays, running,
    until its worker reports, or is published again once that time is over) instead
    of deleted; a row that used up its attempts under the ``block`` policy is
    blocked (its key waits) instead of dead-lettered. Unkeyed rows are untouched.
    """
    orderings = {
        m.id: ordering_of(m) for m in messages if m.envelope.ordering_key is not None
    }
    if not orderings:
        return settlement
    held = {i for i in settlement.delete if i in orderings and orderings[i].strict}
    blocked = [
        Decision(d.message_id, Action.BLOCK, 0.0, d.error)
        for d in settlement.dead_letter
        if d.message_id in orderings and orderings[d.message_id].policy is Policy.BLOCK
    ]
    if not held and not blocked:
        return settlement
    blocked_ids = {d.message_id for d in blocked}
    return dataclasses.replace(
        settlement,
        delete=tuple(i for i in settlement.delete if i not in held),
        dead_letter=tuple(
            d for d in settlement.dead_letter if d.message_id not in blocked_ids
        ),
        hold=settlement.hold
        + tuple(
            Decision(i, Action.HOLD, running_seconds)
            for i in settlement.delete
            if i in held
        ),
        block=settlement.block + tuple(blocked),
    )


class Report(enum.Enum):
    """What a worker writes back for an ended task: the one settlement of its row."""

    DONE = "done"  # the row goes, the next row of the key may be published
    FAILED = "failed"  # final failure: the key's policy decides (block or skip)
    HELD = "held"  # it runs again by Celery's hand: the key stays held, lease renewed
    AGAIN = "again"  # its run is lost: published again now, still in order


#: Every ending's report. A revoke (in the queue, expired, terminated) is the
#: caller's decision, as a revoke before publish is: the row goes and the key moves
#: on. A lost worker process runs the task again (at least once, as documented).
REPORTS: Mapping[Ending, Report] = {
    Ending.SUCCEEDED: Report.DONE,
    Ending.IGNORED: Report.DONE,
    Ending.REVOKED: Report.DONE,
    Ending.EXPIRED: Report.DONE,
    Ending.TERMINATED: Report.DONE,
    Ending.FAILED: Report.FAILED,
    Ending.REJECTED: Report.FAILED,
    Ending.TIMED_OUT: Report.FAILED,
    Ending.REFUSED: Report.FAILED,
    Ending.RETRIED: Report.HELD,
    Ending.REQUEUED: Report.HELD,
    # Published again when its running lease ends: a run again, as it asked.
    Ending.NOT_REQUEUED: Report.HELD,
    Ending.REPLACED: Report.HELD,
    Ending.LOST: Report.AGAIN,
}


def report_for(ending: Ending) -> Report:
    """The settlement of a strict head whose task ended this way."""
    return REPORTS[ending]
