"""Keys that refuse duplicate enqueues: ``apply_async(..., dedup_key="invoice:42")``.

A key is held by the task that first took it while that task's row waits in the
outbox, and until its ``dedup_window`` (seconds after the enqueue) has passed. A
second enqueue with a held key writes nothing. Taking a key is an INSERT into
``celery_outbox_dedup_key``, whose primary key is the key: a concurrent enqueue of
the same key waits for the first transaction to end, then finds its row (committed)
or takes the key (rolled back), on every database.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.db import IntegrityError, transaction

from ..envelope import Envelope
from .base import StoreBase
from .dialects import DEDUP_TABLE, MESSAGE_TABLE


class DedupKeys(StoreBase):
    """Taking and releasing ``dedup_key`` holds."""

    def hold_keys(self, envelopes: Sequence[Envelope]) -> dict[str, str]:
        """Take each envelope's key for its task, in the caller's transaction.

        Returns ``{task_id: holder_task_id}`` for the envelopes whose key another
        task still holds: those must not be written.
        """
        refused: dict[str, str] = {}
        for envelope in envelopes:
            if envelope.dedup_key is None:
                continue
            holder = self._hold(
                envelope.dedup_key, envelope.task_id, envelope.dedup_window
            )
            if holder is not None:
                refused[envelope.task_id] = holder
        return refused

    def _hold(self, key: str, task_id: str, window: float) -> str | None:
        """None once ``key`` is ``task_id``'s; else the task id that holds it."""
        dialect = self.dialect
        until_sql, until_params = dialect.after(window)
        with self._translated(), transaction.atomic(using=self.alias):
            try:
                # A savepoint of its own: a refused INSERT leaves the caller's
                # transaction usable (PostgreSQL would abort it otherwise).
                with (
                    transaction.atomic(using=self.alias),
                    self.connection.cursor() as cursor,
                ):
                    cursor.execute(
                        f"INSERT INTO {DEDUP_TABLE} (dedup_key, task_id, held_until) "
                        f"VALUES (%s, %s, {until_sql})",
                        [key, task_id, *until_params],
                    )
                return None
            except IntegrityError:
                pass
            with self.connection.cursor() as cursor:
                # A locking read: the latest committed row, whatever the isolation.
                cursor.execute(
                    f"SELECT task_id, CASE WHEN held_until > {dialect.now()} THEN 1 "
                    f"ELSE 0 END FROM {DEDUP_TABLE} WHERE dedup_key = %s"
                    f"{self._for_update()}",
                    [key],
                )
                holder, in_window = cursor.fetchone()
                if int(in_window):
                    return str(holder)
                cursor.execute(
                    f"SELECT 1 FROM {MESSAGE_TABLE} WHERE task_id = %s", [holder]
                )
                if cursor.fetchone() is not None:
                    return str(holder)  # still waiting to be published
                cursor.execute(
                    f"UPDATE {DEDUP_TABLE} SET task_id = %s, held_until = {until_sql} "
                    f"WHERE dedup_key = %s",
                    [task_id, *until_params, key],
                )
        return None

    def purge_dedup_keys(self, chunk_size: int = 1000) -> int:
        """Delete keys no task holds any more (published, window over); how many."""
        dialect = self.dialect
        return self._delete_in_chunks(
            f"SELECT d.dedup_key FROM {DEDUP_TABLE} d "
            f"WHERE d.held_until <= {dialect.now()} AND NOT EXISTS "
            f"(SELECT 1 FROM {MESSAGE_TABLE} m WHERE m.task_id = d.task_id) "
            f"LIMIT %s",
            [],
            lambda keys: (
                f"DELETE FROM {DEDUP_TABLE} WHERE dedup_key IN "
                f"({', '.join(['%s'] * len(keys))}) AND held_until <= "
                f"{dialect.now()} AND NOT EXISTS (SELECT 1 FROM {MESSAGE_TABLE} m "
                f"WHERE m.task_id = {DEDUP_TABLE}.task_id)",
                keys,
            ),
            chunk_size,
        )
