"""One name per state of a message, shared by stats, JSON, the admin, metrics and ``inspect``.

A bottom module: it imports nothing of the package.
"""

from __future__ import annotations

from datetime import datetime

#: In the outbox, due now: the next claim may take it.
DUE = "due"
#: A task held in the outbox until its ETA (``CELERY_OUTBOX_SCHEDULE_AFTER``).
SCHEDULED = "scheduled"
#: Leased to a relay, which is publishing it.
IN_FLIGHT = "in_flight"
#: Refused by the broker at least once; waits for its next attempt.
RETRYING = "retrying"
#: Put back without using an attempt (a broker outage); waits out its delay.
DEFERRED = "deferred"
#: A strict ordered head, published, waiting for its worker (``celery_outbox.ordering``).
RUNNING = "running"
#: A failed ordered head that stops its key until an operator acts.
BLOCKED = "blocked"
#: A flow's task whose key is at its limit: it waits for a slot of its key
#: (``celery_outbox.flow``), woken when one frees.
PARKED = "parked"
#: In the dead letters.
DEAD = "dead"
#: Confirmed by the broker and gone from the outbox (known from the history only).
PUBLISHED = "published"
#: Revoked (``revoke()``) before it was published: its row was deleted (history only).
REVOKED = "revoked"


def row_state(
    *,
    due: bool,
    leased: bool,
    attempts: int,
    ordering_state: str | None = None,
    scheduled: bool = False,
) -> str:
    """The state of an outbox row from its columns, ``due`` judged by the database clock.

    ``scheduled``: the row's ``due_at`` (its ETA) has not come yet.
    """
    if ordering_state in (RUNNING, BLOCKED, PARKED):
        return ordering_state
    if due:
        return DUE
    if leased:
        return IN_FLIGHT
    if scheduled:
        return SCHEDULED
    if attempts > 0:
        return RETRYING
    return DEFERRED


def message_state(
    lease_token: str | None,
    available_at: datetime,
    attempts: int,
    now: datetime,
    due_at: datetime | None = None,
) -> str:
    """``due``, ``in_flight``, ``scheduled``, ``retrying`` or ``deferred`` (put back
    after an outage).

    The same names as ``outbox tasks stats`` (text, JSON) and the metrics use.
    """
    return row_state(
        due=available_at <= now,
        leased=bool(lease_token),
        attempts=attempts,
        scheduled=due_at is not None and due_at > now,
    )
