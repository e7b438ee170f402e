"""Ordering decisions, as pure functions over values (no database, no broker).

* :func:`ordered_settlement`: what becomes of a batch's keyed rows after publishing
  (a strict head is held, a failed head of a ``block`` key is blocked);
* :func:`run_length`: how many rows of one key a claim may take after its head;
* :func:`superseded`: which claimed rows coalescing drops;
* :func:`report_for`: what a worker reports for a strict task's final state.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..envelope import StoredMessage
from ..outcomes import Action, Decision, Settlement
from .options import UNORDERED, Ordering, Policy


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


@dataclass(frozen=True)
class Follower:
    """A row of a key after the claimed head, in id order, as the claim sees it."""

    #: Due and in no ordering state (not running, not blocked).
    ready: bool
    strict: bool


def run_length(followers: Iterable[Follower], room: int) -> int:
    """How many of a head's followers (id order) the same claim may take, at most ``room``.

    The run stops before the first row that is not ready, and after a strict row: the
    row after a strict one waits until that one has run.
    """
    taken = 0
    for follower in followers:
        if taken >= room or not follower.ready:
            break
        taken += 1
        if follower.strict:
            break
    return taken


def superseded(
    claimed: Iterable[tuple[int, str, str]], newest: Mapping[tuple[str, str], int]
) -> frozenset[int]:
    """The claimed rows (id, key, task name) that a newer row of their group replaces."""
    return frozenset(
        row_id for row_id, key, task in claimed if newest.get((key, task), 0) > row_id
    )


class Report(enum.Enum):
    """What a worker writes back for a strict task."""

    DONE = "done"  # the row goes, the next row of the key may be published
    FAILED = "failed"  # final failure: the key's policy decides (block or skip)
    RETRYING = "retrying"  # the key stays held; the lease is renewed
    NOTHING = "nothing"  # e.g. rejected and requeued: the lease decides


def report_for(state: str) -> Report:
    """The report for a task's state after a run (``task_postrun``'s ``state``)."""
    if state in ("SUCCESS", "IGNORED"):
        return Report.DONE
    if state == "FAILURE":
        return Report.FAILED
    if state == "RETRY":
        return Report.RETRYING
    return Report.NOTHING
