"""An in-memory store: a real :class:`~.protocol.RelayStore` for tests without a database.

It keeps the rules of :class:`~celery_outbox.store.store.RelayQueries` -- due rows
claimed oldest first under a lease, every write fenced by the lease token, retries
counting an attempt, dead letters keeping the message and the reason -- with time
taken from an injected clock, so a test can move past a lease or a backoff without
sleeping. Its :class:`Tables` are shared with the operator's twin
(:mod:`.memory_operator`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..envelope import Envelope, StoredMessage
from ..flow_limits import HELD_PREFIX
from ..outcomes import Decision, Settlement
from ..text import storable
from .types import Claim, Leftover, SettleReport


@dataclass(frozen=True)
class Row:
    """One outbox row: the message and its delivery state."""

    id: int
    envelope: Envelope
    created_at: float
    #: When the row is next due: after its lease, or its retry or release delay.
    available_at: float
    attempts: int = 0
    last_error: str = ""
    #: The token of the last claim; cleared by a retry or a release.
    lease_token: str | None = None
    #: A scheduled task's ETA (its age counts from it).
    due_at: float | None = None


@dataclass(frozen=True)
class DeadRow:
    """A dead letter: the message, the attempts it used and why it died."""

    #: The dead letter's own id (what a replay selects by).
    id: int
    #: The id the message had in the outbox.
    original_id: int
    envelope: Envelope
    attempts: int
    last_error: str
    created_at: float
    dead_at: float


class Tables:
    """The outbox and its dead letters in memory, behind one lock, on one clock.

    The in-memory role objects share them as the Django ones share a database;
    each holds the lock while it reads or changes them.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` gives the time of leases, delays, ages and ``dead_at``."""
        self.clock = clock
        self.lock = threading.Lock()
        #: Outbox rows by id.
        self.rows: dict[int, Row] = {}
        #: Dead letters by their own id, in the order they died.
        self.dead: dict[int, DeadRow] = {}
        self._next_id = 1
        self._next_dead_id = 1

    def add_rows(self, envelopes: Iterable[Envelope], now: float) -> list[int]:
        """New rows, due at ``now`` (a scheduled one at its ETA), no attempt used; their ids (lock held)."""
        ids = []
        for envelope in envelopes:
            due = None if envelope.due_in is None else now + envelope.due_in
            row = Row(
                self._next_id,
                envelope,
                created_at=now,
                available_at=now if due is None else due,
                due_at=due,
            )
            self.rows[row.id] = row
            self._next_id += 1
            ids.append(row.id)
        return ids

    def bury(self, row: Row, attempts: int, error: str, now: float) -> None:
        """Move ``row`` to the dead letters with ``error`` (lock held)."""
        del self.rows[row.id]
        dead = DeadRow(
            self._next_dead_id,
            row.id,
            row.envelope,
            attempts,
            storable(error),
            row.created_at,
            now,
        )
        self.dead[dead.id] = dead
        self._next_dead_id += 1


class InMemoryStore:
    """Outbox rows in a dict, behind a lock: the relay claims on a second thread too."""

    #: Claims may run on several threads at once, as on PostgreSQL.
    concurrent_claims = True

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        alias: str = "memory",
        tables: Tables | None = None,
    ) -> None:
        """``clock`` gives the time of leases and delays; ``alias`` names the store in
        logs; ``tables`` are shared with another in-memory role (their clock wins)."""
        self.tables = tables if tables is not None else Tables(clock)
        self.clock = self.tables.clock
        self.alias = alias
        self._rows = self.tables.rows
        self._lock = self.tables.lock

    # -- enqueue ---------------------------------------------------------------

    def add(self, envelopes: Iterable[Envelope]) -> list[int]:
        """Enqueue messages as a committed transaction would; their new ids, in order."""
        with self._lock:
            return self.tables.add_rows(envelopes, self.clock())

    def insert(self, envelopes: Sequence[Envelope], *, notify: bool = False) -> None:
        """Enqueue messages as a committed transaction would (no relay to wake)."""
        self.add(envelopes)

    # -- RelayStore ------------------------------------------------------------

    def relay_lock(self) -> AbstractContextManager[None]:
        """Nothing to hold: several relays may share an in-memory store."""
        return contextlib.nullcontext()

    def claim(
        self, limit: int, lease_seconds: float, *, task_ids: Sequence[str] = ()
    ) -> Claim:
        """Lease up to ``limit`` due rows, oldest due first (ties: lowest id)."""
        token = uuid.uuid4().hex
        wanted = frozenset(task_ids)
        with self._lock:
            now = self.clock()
            due = sorted(
                (
                    row
                    for row in self._rows.values()
                    if row.available_at <= now
                    and (not wanted or row.envelope.task_id in wanted)
                ),
                key=lambda row: (row.available_at, row.id),
            )[:limit]
            leased = [
                replace(row, available_at=now + lease_seconds, lease_token=token)
                for row in due
            ]
            for row in leased:
                self._rows[row.id] = row
        # Handed out in id order, as RelayQueries does.
        messages = tuple(
            StoredMessage(
                row.id,
                row.attempts,
                row.envelope,
                now - (row.created_at if row.due_at is None else row.due_at),
            )
            for row in sorted(leased, key=lambda row: row.id)
        )
        return Claim(token, messages)

    def settle(self, token: str, settlement: Settlement) -> SettleReport:
        """Apply a batch's decisions to the rows ``token`` still holds."""
        with self._lock:
            now = self.clock()
            deleted = sum(
                self._take(token, row_id) is not None for row_id in settlement.delete
            )
            retried = sum(self._requeue(token, d, now, 1) for d in settlement.retry)
            released = sum(self._requeue(token, d, now, 0) for d in settlement.release)
            dead = sum(self._bury(token, d, now) for d in settlement.dead_letter)
        return SettleReport(deleted, retried, dead, released)

    def seconds_until_due(self) -> float | None:
        """Seconds until the first row not yet due falls due; None when none waits."""
        with self._lock:
            now = self.clock()
            later = [
                r.available_at for r in self._rows.values() if r.available_at > now
            ]
        return min(later) - now if later else None

    def leftover(self) -> Leftover:
        """The rows no claim holds, by what they wait for (no ordered keys here)."""
        with self._lock:
            now = self.clock()
            rows = [
                r
                for r in sorted(self._rows.values(), key=lambda row: row.id)
                if r.lease_token is None
                and not (r.due_at is not None and r.due_at > now)
            ]
        held = [r for r in rows if r.last_error.startswith(HELD_PREFIX)]
        deferred = [r for r in rows if r not in held and r.attempts == 0]
        retrying = [r for r in rows if r not in held and r.attempts > 0]
        return Leftover(
            deferred=len(deferred),
            retrying=len(retrying),
            flow_held=len(held),
            deferred_error=_latest_error(deferred),
            retrying_error=_latest_error(retrying),
        )

    def renew(self, token: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of those of ``ids`` that ``token`` still holds."""
        with self._lock:
            now = self.clock()
            renewed = 0
            for row_id in ids:
                row = self._held(token, row_id)
                if row is not None:
                    self._rows[row_id] = replace(row, available_at=now + lease_seconds)
                    renewed += 1
            return renewed

    def reset_connection(self) -> None:
        """No connection to drop."""

    # -- inspection ------------------------------------------------------------

    @property
    def rows(self) -> tuple[Row, ...]:
        """Every row still in the outbox, by id."""
        with self._lock:
            return tuple(sorted(self._rows.values(), key=lambda row: row.id))

    @property
    def dead(self) -> tuple[DeadRow, ...]:
        """The dead letters, in the order they died."""
        with self._lock:
            return tuple(self.tables.dead.values())

    def pending(self) -> int:
        """How many rows are in the outbox, due, leased or waiting for a retry."""
        with self._lock:
            return len(self._rows)

    # -- internals (called with the lock held) ---------------------------------

    def _held(self, token: str, row_id: int) -> Row | None:
        row = self._rows.get(row_id)
        return row if row is not None and row.lease_token == token else None

    def _take(self, token: str, row_id: int) -> Row | None:
        row = self._held(token, row_id)
        if row is not None:
            del self._rows[row_id]
        return row

    def _requeue(self, token: str, decision: Decision, now: float, used: int) -> bool:
        row = self._held(token, decision.message_id)
        if row is None:
            return False
        self._rows[row.id] = replace(
            row,
            attempts=row.attempts + used,
            last_error=storable(decision.error),
            available_at=now + decision.delay,
            lease_token=None,
        )
        return True

    def _bury(self, token: str, decision: Decision, now: float) -> bool:
        row = self._held(token, decision.message_id)
        if row is None:
            return False
        self.tables.bury(row, row.attempts + 1, decision.error, now)
        return True


def _latest_error(rows: Sequence[Row]) -> str:
    """The reason recorded on the newest of ``rows`` that has one."""
    return next((r.last_error for r in reversed(rows) if r.last_error), "")


if TYPE_CHECKING:  # mypy checks here that the fake implements the interfaces
    from .protocol import EnqueueStore, RelayStore

    _relay: type[RelayStore] = InMemoryStore
    _enqueue: type[EnqueueStore] = InMemoryStore
