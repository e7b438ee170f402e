"""Relay heartbeats: each running relay's row, and ending the leases of a dead one.

A relay claims under its heartbeat id (the ``holder`` column) and writes its
heartbeat every few seconds from a thread of its own. A relay killed with ``kill -9``
stops beating; the next heartbeat of any other relay finds its row stale and ends
the leases of the rows it held, which become due at once, exactly as if their lease
had run out. The lease token stays on the rows, so the fencing is the one of an
expired lease: a late settlement of the stale relay still deletes a row nobody has
claimed since, and changes nothing on a row another relay claimed.

Nothing here runs in the claim: the hot path only writes one more column.
"""

from __future__ import annotations

from django.db import transaction

from ..text import storable
from .base import StoreBase
from .dialects import MESSAGE_TABLE, RELAY_TABLE, placeholders


class RelayRegistry(StoreBase):
    """The heartbeat table and the takeover of a dead relay's leases."""

    def beat(self, relay_id: str, name: str) -> None:
        """Record that ``relay_id`` is alive now (database clock); adds its row if gone.

        The row comes back even after another relay took this one for dead and
        removed it (a long database stall): later claims are then covered again.
        """
        now = self.dialect.now()
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            cursor.execute(
                f"UPDATE {RELAY_TABLE} SET seen_at = {now} WHERE id = %s", [relay_id]
            )
            if cursor.rowcount == 0:
                cursor.execute(
                    f"INSERT INTO {RELAY_TABLE} (id, name, seen_at) "
                    f"VALUES (%s, %s, {now})",
                    [relay_id, storable(name, 255)],
                )

    def take_over(self, stale_seconds: float) -> int:
        """End the leases held by relays silent for ``stale_seconds``; how many rows.

        The stale relays' heartbeat rows are removed in the same transaction. Rows
        the stale relay had put back for a retry carry no holder and keep their delay.
        """
        dialect = self.dialect
        before_sql, before_params = dialect.after(-stale_seconds)
        now = dialect.now()
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            # One relay takes a dead one over; the others skip it and go on.
            cursor.execute(
                f"SELECT id FROM {RELAY_TABLE} WHERE seen_at < {before_sql}"
                f"{self._skip_locked()}",
                before_params,
            )
            stale = [str(row[0]) for row in cursor.fetchall()]
            if not stale:
                return 0
            # Without an index on holder this reads the rows not yet due through
            # the available_at index: leased and delayed rows, never the backlog.
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET available_at = {now} "
                f"WHERE available_at > {now} AND holder IN ({placeholders(stale)})",
                stale,
            )
            ended = int(cursor.rowcount)
            cursor.execute(
                f"DELETE FROM {RELAY_TABLE} WHERE id IN ({placeholders(stale)})", stale
            )
        return ended

    def leave(self, relay_id: str) -> None:
        """Remove ``relay_id``'s heartbeat (a relay that stops cleanly)."""
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {RELAY_TABLE} WHERE id = %s", [relay_id])

    def _skip_locked(self) -> str:
        features = self.connection.features
        if not features.has_select_for_update_skip_locked:
            return ""
        return " FOR UPDATE SKIP LOCKED"
