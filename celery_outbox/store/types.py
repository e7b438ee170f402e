"""Values the store returns: claims, settlement reports, statistics, operator reports."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..envelope import (
    StoredMessage,
)
from ..outcomes import Decision

if TYPE_CHECKING:
    from .ordering import CoalescedRow


@dataclass(frozen=True)
class Claim:
    """Rows leased to one relay under one token."""

    token: str
    messages: tuple[StoredMessage, ...]
    #: Rows this relay cannot read (a newer payload version), handed back as dead letters.
    unreadable: tuple[Decision, ...] = ()
    #: Rows deleted at claim time because a newer row of their coalescing group waits.
    coalesced: tuple[CoalescedRow, ...] = ()


@dataclass(frozen=True)
class SettleReport:
    """How many rows each part of a settlement changed; fewer than asked means a lost lease."""

    deleted: int = 0
    retried: int = 0
    dead_lettered: int = 0
    released: int = 0
    #: Strict heads left running, and failed heads blocked (celery_outbox.ordering).
    held: int = 0
    blocked: int = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of the outbox."""

    pending: int
    due: int
    in_flight: int
    dead: int
    #: Of the rows not scheduled: the age of the oldest (a scheduled row counts from
    #: its ETA once that has passed).
    oldest_pending_seconds: float | None
    #: Rows held until their ETA, and the seconds until the first of them is due.
    scheduled: int = 0
    next_due_seconds: float | None = None
    #: Rows in the ``blocked`` state: one head per ordered key it stops
    #: (:mod:`celery_outbox.ordering`), until an operator acts.
    blocked: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of ``outbox tasks stats --format json``."""
        return {
            "pending": self.pending,
            "due": self.due,
            "in_flight": self.in_flight,
            "dead": self.dead,
            "oldest_pending_seconds": self.oldest_pending_seconds,
            "scheduled": self.scheduled,
            "next_due_seconds": self.next_due_seconds,
        }


@dataclass(frozen=True)
class BacklogGroup:
    """Waiting rows of one task name on one queue."""

    task_name: str
    queue: str
    pending: int
    due: int
    oldest_seconds: float | None


@dataclass(frozen=True)
class Summary:
    """What an operator looks at first: totals, the oldest age and the biggest backlogs."""

    pending: int
    due: int
    retrying: int
    in_flight: int
    dead: int
    oldest_pending_seconds: float | None
    backlog: tuple[BacklogGroup, ...] = ()
    #: Rows held until their ETA, and the seconds until the first of them is due.
    scheduled: int = 0
    next_due_seconds: float | None = None
    #: Rows parked for a slot of their flow key, by the flow that parked them
    #: (one no longer configured included; "" when none is named).
    parked: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class RetryingTask:
    """Outbox rows of one task name that the broker refused at least once."""

    task_name: str
    rows: int
    attempts: int
    max_attempts: int


@dataclass(frozen=True)
class DeadTask:
    """Dead letters of one task name."""

    task_name: str
    dead: int


@dataclass(frozen=True)
class TopFailures:
    """The task names that fail most, in the outbox and among the dead letters."""

    retrying: tuple[RetryingTask, ...]
    dead: tuple[DeadTask, ...]


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters to replay: every given condition must hold.

    ``ids`` are dead-letter ids (None: any id; an empty tuple matches nothing),
    ``task`` a task name or glob (``shop.*``), and ``since``/``until`` bound
    ``dead_at`` (``since <= dead_at < until``).
    """

    ids: tuple[int, ...] | None = None
    task: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    @property
    def is_empty(self) -> bool:
        """Whether no condition was given (the filter matches every dead letter)."""
        return (
            self.ids is None
            and self.task is None
            and self.since is None
            and self.until is None
        )


@dataclass(frozen=True)
class ReplayReport:
    """What a replay did (or, with ``dry_run``, would do)."""

    matched: int
    replayed: int
    dry_run: bool
    by_task: Mapping[str, int] = field(default_factory=dict)
    #: Ids of the dead letters that were replayed (and deleted).
    ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PurgeReport:
    """How many dead letters a purge deleted (or, with ``dry_run``, would delete)."""

    matched: int
    deleted: int
    dry_run: bool


#: Called after each replayed chunk with (replayed so far, total matched).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Leftover:
    """The rows waiting in the outbox that no relay holds, by what they wait for.

    Read by the database clock when a relay run ``--until-empty`` ends. Scheduled
    rows (before their ETA) and published strict heads waiting for their worker are
    not counted: no relay may send them now, and nothing is wrong.
    """

    #: Rows with no attempt used that are not held back: put back by a broker
    #: outage (their next try after the cooldown), or due and not claimed.
    deferred: int = 0
    #: Rows the broker refused, waiting for their next attempt.
    retrying: int = 0
    #: Rows a flow holds back: paced by its rate, or parked until a slot of their
    #: flow key frees.
    flow_held: int = 0
    #: Rows behind the head of their ordered key (running or blocked), and blocked
    #: heads.
    key_held: int = 0
    #: The latest reason recorded on a deferred row, and on a retrying row.
    deferred_error: str = ""
    retrying_error: str = ""
