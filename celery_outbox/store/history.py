"""Each message's history (``CELERY_OUTBOX_HISTORY``), and where a message is now.

With history on, the statements that settle a batch also copy what happened to each
row into ``celery_outbox_history``: one ``INSERT ... SELECT`` per kind of outcome
per batch, read from the rows the settlement is about to change, in its transaction.
Nothing is written at enqueue: an event carries its row's ``created_at`` as
``enqueued_at``. Events: ``published`` (also a strict head left running),
``retrying`` (the broker refused an attempt; with its reason), ``blocked``, ``dead``
(with the reason), ``replayed`` (with the dead letter's last reason) and ``revoked``
(``revoke()`` deleted the row before it was published). A broker outage uses no
attempt and writes no event.

The retention purge deletes in id order: ids grow with time, so the old events are
the first ones, and no index on ``at`` has to be kept up to date by every settlement.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models.expressions import RawSQL

from ..conf import get_settings
from ..exceptions import OutboxConfigurationError, OutboxDatabaseError
from ..states import BLOCKED, PUBLISHED, RETRYING, row_state
from ..text import storable
from .base import StoreBase
from .dialects import (
    DEAD_TABLE,
    HISTORY_TABLE,
    MESSAGE_TABLE,
    case_by_id,
    chunked,
    placeholders,
)

REPLAYED = "replayed"

_COLUMNS = (
    "task_id, task_name, event, at, enqueued_at, attempt, error, relay_id, process"
)


@dataclass(frozen=True)
class HistoryEntry:
    """One event of a message's history."""

    event: str
    task_name: str
    at: datetime
    enqueued_at: datetime
    #: Attempts the message had used once this happened.
    attempt: int
    error: str
    #: The relay's heartbeat id (None: publish-on-commit, a command, the admin).
    relay_id: str | None
    #: ``host:pid`` of the process that wrote the event.
    process: str


@dataclass(frozen=True)
class WaitingRow:
    """A row of the task in the outbox, with its state by the database clock."""

    id: int
    task_name: str
    state: str
    attempts: int
    last_error: str
    created_at: datetime
    #: The next attempt (retrying, deferred), or the end of the lease (in_flight).
    available_at: datetime
    #: The heartbeat id of the relay holding the lease, and its ``host:pid`` while
    #: its heartbeat row is there ("" once it is gone).
    holder: str | None
    holder_name: str
    #: A scheduled task's ETA (None for other rows).
    due_at: datetime | None = None


@dataclass(frozen=True)
class DeadEntry:
    """A dead letter of the task."""

    id: int
    task_name: str
    attempts: int
    last_error: str
    created_at: datetime
    dead_at: datetime


@dataclass(frozen=True)
class MessageTrace:
    """Everything the store knows of one task id: rows, dead letters, history."""

    task_id: str
    rows: tuple[WaitingRow, ...]
    dead: tuple[DeadEntry, ...]
    events: tuple[HistoryEntry, ...]
    #: Whether this store writes history (off: a published message leaves no trace).
    history: bool

    @property
    def found(self) -> bool:
        """Whether anything at all is known of the task id."""
        return bool(self.rows or self.dead or self.events)


def process_name() -> str:
    """``host:pid`` of this process, as a relay's heartbeat names it."""
    return storable(f"{socket.gethostname()}:{os.getpid()}", 255)


class HistoryWriter(StoreBase):
    """Writing the history inside the caller's transaction: the part the relay's
    settlements and the operator's moves share (:class:`HistoryLog` reads it).

    ``history`` says whether they write it; None: ``CELERY_OUTBOX_HISTORY``.
    """

    def __init__(
        self, alias: str, *, holder: str | None = None, history: bool | None = None
    ) -> None:
        super().__init__(alias, holder=holder)
        if history is None:
            history = get_settings().history
        self.history = history

    def check_history(self) -> None:
        """With history on, refuse to go on without its table (a relay, ``health``).

        Otherwise every settlement would fail after its batch was published, and
        the rows would be published again and again.
        """
        if not self.history:
            return
        try:
            with self._translated(), self.connection.cursor() as cursor:
                cursor.execute(f"SELECT 1 FROM {HISTORY_TABLE} WHERE 1 = 0", [])
                cursor.fetchall()
        except OutboxDatabaseError as exc:
            if HISTORY_TABLE in self._table_names():
                raise
            raise OutboxConfigurationError(
                f"CELERY_OUTBOX_HISTORY is on, but outbox database {self.alias!r} has "
                f"no table {HISTORY_TABLE}. Run: python manage.py migrate "
                f"celery_outbox --database {self.alias}"
            ) from exc

    def _table_names(self) -> list[str]:
        try:
            return list(self.connection.introspection.table_names())
        except Exception:  # unreachable: the first error says enough
            return [HISTORY_TABLE]

    # -- written inside the caller's transaction ------------------------------------

    def record_outbox(
        self,
        cursor: Any,
        event: str,
        ids: Sequence[int],
        *,
        errors: Mapping[int, str] | str = "",
        used: int = 0,
        token: str | None = None,
    ) -> None:
        """One event for each outbox row of ``ids`` (held under ``token`` if given).

        ``errors`` is a reason per id, or one for all; ``used`` the attempts the
        event itself uses. Runs before the statement that changes the rows.
        """
        if not self.history or not ids:
            return
        dialect = self.dialect
        fence, fence_params = ("lease_token = %s AND ", [token]) if token else ("", [])
        # One reason for all: one statement. A reason per row: one per chunk.
        for chunk in [ids] if isinstance(errors, str) else chunked(ids):
            among_sql, among_params = dialect.among("id", chunk)
            error_sql, error_params = _reasons(errors, chunk)
            cursor.execute(
                f"INSERT INTO {HISTORY_TABLE} ({_COLUMNS}) SELECT task_id, task_name, "
                f"'{event}', {dialect.now()}, created_at, attempts + {int(used)}, "
                f"{error_sql}, %s, %s FROM {MESSAGE_TABLE} WHERE {fence}{among_sql}",
                [
                    *error_params,
                    self.holder,
                    process_name(),
                    *fence_params,
                    *among_params,
                ],
            )

    def record_settlement(
        self,
        cursor: Any,
        token: str,
        published: Sequence[int],
        retried: Sequence[tuple[int, str]],
        blocked: Sequence[tuple[int, str]],
    ) -> None:
        """A batch's published, refused and blocked rows; one statement per kind."""
        self.record_outbox(cursor, PUBLISHED, published, used=1, token=token)
        for event, refused in ((RETRYING, retried), (BLOCKED, blocked)):
            self.record_outbox(
                cursor,
                event,
                [row_id for row_id, _ in refused],
                errors=dict(refused),
                used=1,
                token=token,
            )

    def record_replayed(self, cursor: Any, dead_ids: Sequence[int]) -> None:
        """A ``replayed`` event per dead letter, keeping its last reason."""
        if not self.history or not dead_ids:
            return
        cursor.execute(
            f"INSERT INTO {HISTORY_TABLE} ({_COLUMNS}) SELECT task_id, task_name, "
            f"'{REPLAYED}', {self.dialect.now()}, created_at, attempts, last_error, "
            f"%s, %s FROM {DEAD_TABLE} WHERE id IN ({placeholders(dead_ids)})",
            [self.holder, process_name(), *dead_ids],
        )


class HistoryLog(HistoryWriter):
    """Where a message is and what happened to it, and the history's retention."""

    def trace(self, task_id: str) -> MessageTrace:
        """Where ``task_id`` is: its outbox rows, dead letters and history, by id."""
        from ..models import DeadLetter, HistoryEvent, OutboxMessage, RelayHeartbeat

        alias = self.alias
        now = self.dialect.now()
        due = RawSQL(f"CASE WHEN available_at <= {now} THEN 1 ELSE 0 END", [])
        ahead = RawSQL(f"CASE WHEN due_at > {now} THEN 1 ELSE 0 END", [])
        with self._translated():
            rows = list(
                OutboxMessage.objects.using(alias)
                .filter(task_id=task_id)
                .annotate(is_due=due, is_ahead=ahead)
                .order_by("id")
                .values_list(
                    "id",
                    "task_name",
                    "is_due",
                    "lease_token",
                    "state",
                    "attempts",
                    "last_error",
                    "created_at",
                    "available_at",
                    "holder",
                    "is_ahead",
                    "due_at",
                )
            )
            holders = {str(row[9]) for row in rows if row[9]}
            names = dict(
                RelayHeartbeat.objects.using(alias)
                .filter(id__in=holders)
                .values_list("id", "name")
            )
            dead = tuple(
                DeadEntry(*values)
                for values in DeadLetter.objects.using(alias)
                .filter(task_id=task_id)
                .order_by("id")
                .values_list(
                    "id", "task_name", "attempts", "last_error", "created_at", "dead_at"
                )
            )
            events = tuple(
                HistoryEntry(*values)
                for values in HistoryEvent.objects.using(alias)
                .filter(task_id=task_id)
                .order_by("id")
                .values_list(
                    "event",
                    "task_name",
                    "at",
                    "enqueued_at",
                    "attempt",
                    "error",
                    "relay_id",
                    "process",
                )
            )
        waiting = tuple(
            WaitingRow(
                id=row_id,
                task_name=name,
                state=row_state(
                    due=bool(int(is_due)),
                    leased=bool(token),
                    attempts=attempts,
                    ordering_state=ordering_state,
                    scheduled=bool(int(is_ahead)),
                ),
                attempts=attempts,
                last_error=error,
                created_at=created,
                available_at=available,
                holder=holder,
                holder_name=names.get(holder, "") if holder else "",
                due_at=due_at,
            )
            for (
                row_id,
                name,
                is_due,
                token,
                ordering_state,
                attempts,
                error,
                created,
                available,
                holder,
                is_ahead,
                due_at,
            ) in rows
        )
        return MessageTrace(task_id, waiting, dead, events, self.history)

    # -- retention -------------------------------------------------------------------

    def purge_history(self, older_than: float, chunk_size: int = 5000) -> int:
        """Delete events older than ``older_than`` seconds, in chunks; how many.

        The first event not that old bounds the work: events are deleted by id
        below it, ``chunk_size`` at a time, each chunk in a transaction of its own.
        """
        dialect = self.dialect
        with self._translated(), self.connection.cursor() as cursor:
            cutoff_sql, cutoff_params = dialect.after(-older_than)
            cursor.execute(f"SELECT {cutoff_sql}", cutoff_params)
            (cutoff,) = cursor.fetchone()
            # Walks the primary key from the start: through the old events only.
            cursor.execute(
                f"SELECT id FROM {HISTORY_TABLE} WHERE at >= %s ORDER BY id LIMIT 1",
                [cutoff],
            )
            young = cursor.fetchone()
        bound = "" if young is None else " AND id < %s"
        bound_params = [] if young is None else [int(young[0])]
        return self._delete_in_chunks(
            f"SELECT id FROM {HISTORY_TABLE} WHERE at < %s{bound} ORDER BY id LIMIT %s",
            [cutoff, *bound_params],
            lambda ids: (
                f"DELETE FROM {HISTORY_TABLE} WHERE id >= %s AND id <= %s AND at < %s",
                [min(ids), max(ids), cutoff],
            ),
            chunk_size,
        )


def _reasons(
    errors: Mapping[int, str] | str, ids: Sequence[int]
) -> tuple[str, list[Any]]:
    """SQL for the reason of each row of ``ids`` (``CASE id ...``), or for one for all."""
    if isinstance(errors, str):
        return "%s", [storable(errors)]
    return case_by_id({row_id: storable(errors[row_id]) for row_id in ids})
