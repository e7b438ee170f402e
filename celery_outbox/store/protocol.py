"""The store by role: one small interface per kind of consumer.

Each consumer is typed against the role it uses and holds an object of that role
only: the relay a :class:`RelayStore`, the enqueue path an :class:`EnqueueStore`
(and a :class:`DedupStore` for ``dedup_key``), the admin and the ``outbox``
commands an :class:`OperatorStore`, and so on. :class:`~.roles.Stores` builds the
Django implementation of each on one database alias; :mod:`.memory` and
:mod:`.memory_operator` hold in-memory twins of the relay's and the operator's.
``tests/contract`` holds one contract suite per role, run on every implementation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from ..outcomes import Settlement
from .types import (
    Claim,
    DeadLetterFilter,
    Leftover,
    Progress,
    PurgeReport,
    ReplayReport,
    SettleReport,
    Stats,
    Summary,
    TopFailures,
)

if TYPE_CHECKING:
    from ..envelope import Envelope
    from ..flow_limits import Candidate, Decided, Flow, FlowStats, Grant, Limits, Rate
    from ..ordering_options import Policy
    from .events import DeadEvent
    from .history import MessageTrace
    from .ordering import BlockedHead, OrderingStats


class RelayStore(Protocol):
    """Claims due rows under a lease and settles them, fenced by the lease token.

    A row is due once its ``available_at`` has passed. Claiming leases it: it stays
    out of every other claim for ``lease_seconds`` and carries the claim's token.
    Every later write for the row (settle, renew) names that token and changes
    nothing once another claim has taken the row: a relay that lost its lease can
    never delete, retry or dead-letter what another relay now holds.
    """

    @property
    def alias(self) -> str:
        """The name of the database the rows live in (for logs)."""
        ...

    @property
    def concurrent_claims(self) -> bool:
        """Whether several claims may run at once (another thread, another relay)."""
        ...

    def relay_lock(self) -> AbstractContextManager[None]:
        """Held while a relay runs; refuses a second relay where only one may claim."""
        ...

    def claim(
        self, limit: int, lease_seconds: float, *, task_ids: Sequence[str] = ()
    ) -> Claim:
        """Lease up to ``limit`` due rows, oldest due first, to a new token.

        Rows held by a live lease are skipped; ``task_ids`` restricts the claim to
        those tasks' rows.
        """
        ...

    def settle(self, token: str, settlement: Settlement) -> SettleReport:
        """Delete, retry, release and dead-letter rows still held under ``token``.

        A retry uses an attempt and records the error; a release uses none. Both make
        the row due again after the decision's delay. The report counts the rows each
        part changed; fewer than asked means the lease on the others was lost.
        """
        ...

    def seconds_until_due(self) -> float | None:
        """Seconds until the next row not yet due falls due (a scheduled task, a
        retry, a lease's end); None when no row waits."""
        ...

    def leftover(self) -> Leftover:
        """The rows no relay holds that wait in the outbox, by what they wait for
        (scheduled rows and running strict heads aside)."""
        ...

    def renew(self, token: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease on those of ``ids`` still held under ``token``; how many."""
        ...

    def reset_connection(self) -> None:
        """Drop a connection that failed, so that the next call reconnects."""
        ...


class EnqueueStore(Protocol):
    """Writes new outbox rows, due at once, in the caller's transaction."""

    def insert(self, envelopes: Sequence[Envelope], *, notify: bool = False) -> None:
        """Write the messages as rows with no attempt used; none for an empty list.

        ``notify`` asks, where the database can, for the hint that wakes a relay
        when the transaction commits.
        """
        ...


class DedupStore(Protocol):
    """Keys that refuse a second enqueue while the first task holds them."""

    def hold_keys(self, envelopes: Sequence[Envelope]) -> dict[str, str]:
        """Take each envelope's ``dedup_key`` for its task, in the caller's transaction.

        Returns ``{task_id: holder_task_id}`` for the envelopes whose key another
        task still holds (its row waits, or its window has not passed).
        """
        ...

    def purge_dedup_keys(self, chunk_size: int = ...) -> int:
        """Delete the keys no task holds any more; how many."""
        ...


class OperatorStore(Protocol):
    """What an operator asks of and does to the outbox and its dead letters.

    Rows a relay holds under a live lease are left alone by every change.
    """

    def stats(self) -> Stats:
        """Pending, due, in-flight and dead rows, and the oldest row's age."""
        ...

    def summary(self, groups: int = ...) -> Summary:
        """Totals, rows waiting for a retry, and the largest backlogs by task and queue."""
        ...

    def top_failures(self, limit: int = ...) -> TopFailures:
        """The task names with most refused rows, and with most dead letters."""
        ...

    def retry_now(self, ids: Sequence[int]) -> list[int]:
        """Make those rows due now; the ids changed."""
        ...

    def move_to_dead_letters(self, ids: Sequence[int], reason: str) -> list[int]:
        """Move those rows to the dead letters with ``reason``; the ids moved."""
        ...

    def replay_dead_letters(
        self,
        selection: DeadLetterFilter,
        *,
        dry_run: bool = ...,
        chunk_size: int = ...,
        progress: Progress | None = ...,
    ) -> ReplayReport:
        """Put the matching dead letters back into the outbox, due now, attempts reset.

        With ``dry_run`` nothing changes and the report says what would be replayed.
        """
        ...

    def purge_dead_letters(
        self,
        older_than: float,
        *,
        task: str | None = ...,
        dry_run: bool = ...,
        chunk_size: int = ...,
    ) -> PurgeReport:
        """Delete dead letters older than ``older_than`` seconds (``task``: a glob)."""
        ...

    def delete_dead_letters(self, ids: Sequence[int]) -> list[int]:
        """Delete those dead letters; the ids that existed and were deleted."""
        ...


class OrderingStore(Protocol):
    """Ordered keys' heads: the worker's reports on strict tasks, the operator's
    actions on blocked heads, and the keys' statistics."""

    def task_done(self, task_id: str, row_token: str | None = None) -> int:
        """A strict task finished: its row (``row_token``'s) goes and its key moves on."""
        ...

    def task_failed(
        self, task_id: str, error: str, policy: Policy, row_token: str | None = None
    ) -> int:
        """A strict task failed for good: block its key, or dead-letter it and go on."""
        ...

    def task_retrying(
        self, task_id: str, seconds: float, row_token: str | None = None
    ) -> int:
        """A strict task will run again: its key stays held ``seconds`` from now."""
        ...

    def task_again(self, task_id: str, row_token: str | None = None) -> int:
        """A strict task's run was lost with its worker process: published again now."""
        ...

    def reset_connection(self) -> None:
        """Drop a connection that failed, so that the next call reconnects."""
        ...

    def blocked_heads(self) -> tuple[BlockedHead, ...]:
        """Every blocked key's head, oldest first."""
        ...

    def retry_head(self, key: str) -> int:
        """Make a blocked key's head due now, with fresh attempts."""
        ...

    def dead_letter_head(self, key: str) -> int:
        """Move a blocked key's head to the dead letters: the key goes on."""
        ...

    def skip_head(self, key: str, *, dead_letter: bool = ...) -> int:
        """Take a blocked key's head out (to the dead letters, or deleted)."""
        ...

    def ordering_stats(self, top: int = ...) -> OrderingStats:
        """Keys waiting, their rows, running and blocked heads, the deepest keys."""
        ...


class HistoryStore(Protocol):
    """Where a message is now, what happened to it, and the history's retention."""

    def check_history(self) -> None:
        """With history on, refuse to go on without its table."""
        ...

    def trace(self, task_id: str) -> MessageTrace:
        """The task's outbox rows, dead letters and history events."""
        ...

    def purge_history(self, older_than: float, chunk_size: int = ...) -> int:
        """Delete events older than ``older_than`` seconds; how many."""
        ...


class Membership(Protocol):
    """Where a lane's members beat, and how a silent member's leases end.

    The engine's heartbeat (:mod:`celery_outbox.engine.heartbeat`) drives it: the
    relay's registry and the handler processor's members both are one.
    """

    @property
    def holder(self) -> str | None:
        """The member id this object beats and claims for."""
        ...

    def beat(self, relay_id: str, name: str) -> None:
        """Record that the member is alive now; adds its row if it went."""
        ...

    def take_over(self, stale_seconds: float) -> int:
        """End the leases of members silent for ``stale_seconds``; how many."""
        ...

    def leave(self, relay_id: str) -> None:
        """Remove the member's heartbeat (a member that stops cleanly)."""
        ...

    def reset_connection(self) -> None:
        """Drop a connection that failed, so that the next call reconnects."""
        ...


class RegistryStore(Membership, Protocol):
    """Relay heartbeats, and the takeover of a silent relay's leases."""


class EventStore(Protocol):
    """Event retries the database holds, and a service's archive of dead events."""

    def insert_later(self, envelopes: Sequence[Envelope], delay: float) -> None:
        """Write messages due ``delay`` seconds from now, in the caller's transaction."""
        ...

    def insert_dead(self, envelopes: Sequence[Envelope], reason: str) -> None:
        """Write messages straight into the dead letters with ``reason``."""
        ...

    def dead_events(self, prefix: str, limit: int | None = ...) -> list[DeadEvent]:
        """Dead letters whose routing key starts with ``prefix``, oldest first."""
        ...

    def count_dead_events(self, prefix: str) -> int:
        """How many dead letters are routed to queues starting with ``prefix``."""
        ...

    def waiting_retries(self, prefix: str) -> int:
        """Outbox rows routed to queues starting with ``prefix``."""
        ...


class FlowStore(Protocol):
    """Flow control's state: what the gate reserves, what an operator sees and sets.

    Every relay reserves through the same rows, so a flow's rates hold for the
    whole deployment: :meth:`reserve` decides for one flow at a time and records
    what it grants before the relay publishes it.
    """

    def reserve(self, flow: Flow, wanted: int) -> Grant:
        """Grant up to ``wanted`` publishes of ``flow`` now, under the rates in force
        (an operator's, else the flow's), and record the granted ones as published."""
        ...

    def decide(
        self, flow: Flow, candidates: Sequence[Candidate], token: str
    ) -> Decided:
        """Decide for a batch's rows of a flow with limits per key (claimed under
        ``token``): the keys' limits, then the rates; a slot taken for each row that
        goes; the rows whose key is at a limit put back, parked, in the same
        transaction (a report that frees a slot wakes them)."""
        ...

    def task_started(self, flow: Flow, key: str, task_id: str) -> int:
        """A task of ``key`` started: its slot is no longer queued (taken again if
        it was gone); with a ``queued`` limit, one parked row of the key is woken."""
        ...

    def task_ended(self, flow: Flow, key: str, task_id: str) -> int:
        """A task of ``key`` ended: its slot frees, a parked row of the key is woken."""
        ...

    def task_requeued(self, flow: Flow, key: str, task_id: str) -> int:
        """A run of ``key`` ended and put its task back in the broker: its slot is
        queued again (taken again if gone), nothing woken."""
        ...

    def not_published(self, flow: Flow, rows: Sequence[Candidate]) -> int:
        """``rows`` of ``flow`` took a slot and did not reach the broker: their
        unstarted slots free, a parked row of the key woken for each; how many."""
        ...

    def outlived(self, flow: Flow, depths: Mapping[str, int] | None) -> int:
        """Settle the flow's unstarted slots past their lease by how many messages
        their queues hold (``depths``; None: unknown, they free): those whose task
        still waits stay, their lease from now; the rest free, a parked row of the
        key woken for each; how many freed."""
        ...

    def set_rates(self, name: str, rates: Sequence[Rate] | None) -> None:
        """Put ``rates`` in force for the flow ``name`` at the next decision of every
        relay; None goes back to the settings' rates."""
        ...

    def set_limits(self, name: str, limits: Limits | None) -> None:
        """Put ``limits`` in force for the flow ``name`` at the next decision of
        every relay (its parked rows are woken, no other flow's); None goes back to
        the settings'."""
        ...

    def reconcile(self, flows: Sequence[Flow]) -> dict[str, int]:
        """Release, due now, each row a flow parked or held that the flows of the
        settings (``flows``) no longer hold so: its flow is gone, renamed, lost its
        limits per key or its rates, or no longer covers the task. Each row once,
        however many relays start at once; how many, by the flow that held them."""
        ...

    def flow_stats(self, flows: Sequence[Flow]) -> tuple[FlowStats, ...]:
        """Each flow's rows waiting, its publishes of the last minute, its rates."""
        ...

    def reset_connection(self) -> None:
        """Drop a connection that failed, so that the next call reconnects."""
        ...
