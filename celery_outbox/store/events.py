"""The outbox SQL of events whose retries the database holds (``celery_outbox.events``).

A failed subscriber's retry is an outbox row due a few seconds from now; an event whose
retries are used up is a dead letter written at once. A service's archive is the
dead letters routed to its queues (routing key ``<exchange>:<service>:...``), so the
operator commands (``outbox tasks replay``, ``outbox tasks purge``) work on it as on any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..envelope import Envelope, load_json
from ..text import storable
from .base import StoreBase
from .dialects import (
    DEAD_TABLE,
    INSERT_COLUMNS,
    MESSAGE_COLUMNS,
    MESSAGE_TABLE,
    placeholders,
)
from .store import check_fits, message_values


@dataclass(frozen=True)
class DeadEvent:
    """One dead letter of a service's events, as the archive commands show it."""

    #: The dead letter's row id (what ``outbox tasks replay ID`` takes).
    row_id: int
    task_id: str
    routing_key: str
    headers: dict[str, Any]
    last_error: str
    dead_at: datetime


class EventRows(StoreBase):
    """Delayed retries and archived events in the outbox tables of one alias."""

    def insert_later(self, envelopes: Sequence[Envelope], delay: float) -> None:
        """Write messages due ``delay`` seconds from now (database clock), in the
        caller's transaction."""
        self._insert(envelopes, delay=delay, reason=None)

    def insert_dead(self, envelopes: Sequence[Envelope], reason: str) -> None:
        """Write messages straight into the dead letters with ``reason``, in the
        caller's transaction; ``outbox tasks replay`` puts them back like any other."""
        self._insert(envelopes, delay=0.0, reason=reason)

    def dead_events(self, prefix: str, limit: int | None = None) -> list[DeadEvent]:
        """Dead letters whose routing key starts with ``prefix``, oldest first."""
        from ..models import DeadLetter

        rows = (
            DeadLetter.objects.using(self.alias)
            .filter(routing_key__startswith=prefix)
            .order_by("id")
            .values_list(
                "id", "task_id", "routing_key", "headers", "last_error", "dead_at"
            )
        )
        with self._translated():
            found = list(rows if limit is None else rows[:limit])
        return [
            DeadEvent(int(i), str(t), str(r), _headers(h), str(e), d)
            for i, t, r, h, e, d in found
        ]

    def count_dead_events(self, prefix: str) -> int:
        """How many dead letters are routed to queues starting with ``prefix``."""
        from ..models import DeadLetter

        with self._translated():
            return int(
                DeadLetter.objects.using(self.alias)
                .filter(routing_key__startswith=prefix)
                .count()
            )

    def waiting_retries(self, prefix: str) -> int:
        """Outbox rows routed to queues starting with ``prefix`` (retries not yet due
        or not yet published)."""
        from ..models import OutboxMessage

        with self._translated():
            return int(
                OutboxMessage.objects.using(self.alias)
                .filter(routing_key__startswith=prefix)
                .count()
            )

    def _insert(
        self, envelopes: Sequence[Envelope], *, delay: float, reason: str | None
    ) -> None:
        if not envelopes:
            return
        for envelope in envelopes:
            check_fits(envelope)
        dialect = self.dialect
        now = dialect.now()
        params: list[Any] = []
        if reason is None:
            after_sql, after_params = dialect.after(delay, clock=True)
            row = f"({placeholders(MESSAGE_COLUMNS)}, 0, '', {now}, {after_sql})"
            head = f"INSERT INTO {MESSAGE_TABLE} ({', '.join(INSERT_COLUMNS)})"
            for envelope in envelopes:
                params += [*message_values(envelope), *after_params]
        else:
            columns = ", ".join(MESSAGE_COLUMNS)
            row = f"(0, {placeholders(MESSAGE_COLUMNS)}, 0, %s, {now}, {now})"
            head = (
                f"INSERT INTO {DEAD_TABLE} (original_id, {columns}, attempts, "
                f"last_error, created_at, dead_at)"
            )
            for envelope in envelopes:
                params += [*message_values(envelope), storable(reason)]
        sql = f"{head} VALUES " + ", ".join([row] * len(envelopes))
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(sql, params)


def _headers(text: Any) -> dict[str, Any]:
    try:
        value = load_json(str(text))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
