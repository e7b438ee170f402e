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
from typing import Any

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
        # The window counts from this statement, not from the start of the
        # caller's transaction (PostgreSQL's now()).
        until_sql, until_params = dialect.after(window, clock=True)
        with self._translated(), transaction.atomic(using=self.alias):
            # InnoDB: writers that wait on the INSERT of an uncommitted key hold
            # shared locks on it; when its transaction rolls back, two of them
            # insert at once and deadlock. A locking read waits with an exclusive
            # lock instead, which a rollback leaves to nobody.
            found = self._holder(key) if dialect.duplicates_deadlock else None
            while found is None:
                if self._insert(key, task_id, until_sql, until_params):
                    return None
                found = self._holder(key)  # a concurrent writer took it first
            holder, in_window = found
            if in_window:
                return holder
            with self.connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT 1 FROM {MESSAGE_TABLE} WHERE task_id = %s", [holder]
                )
                if cursor.fetchone() is not None:
                    return holder  # still waiting to be published
                cursor.execute(
                    f"UPDATE {DEDUP_TABLE} SET task_id = %s, held_until = {until_sql} "
                    f"WHERE dedup_key = %s",
                    [task_id, *until_params, key],
                )
        return None

    def _insert(
        self, key: str, task_id: str, until_sql: str, until_params: list[Any]
    ) -> bool:
        """Take ``key`` with an INSERT; False when another task's row holds it."""
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
            return True
        except IntegrityError:
            return False

    def _holder(self, key: str) -> tuple[str, bool] | None:
        """The task holding ``key`` and whether its window is still open; locked.

        A locking read: the latest committed row, whatever the isolation. None when
        no row holds the key.
        """
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT task_id, CASE WHEN held_until > {self.dialect.clock()} THEN 1 "
                f"ELSE 0 END FROM {DEDUP_TABLE} WHERE dedup_key = %s"
                f"{self._for_update()}",
                [key],
            )
            row = cursor.fetchone()
        return None if row is None else (str(row[0]), bool(int(row[1])))

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
