"""Keys that refuse duplicate enqueues: ``apply_async(..., dedup_key="invoice:42")``.

A key is held by the task that first took it while that task's row waits in the
outbox, and until its ``dedup_window`` (seconds after the enqueue) has passed. A
second enqueue with a held key writes nothing. Taking a key is an INSERT into
``celery_outbox_dedup_key``, whose primary key is the key: a concurrent enqueue of
the same key waits for the first transaction to end, then finds its row (committed)
or takes the key (rolled back), on every database.

InnoDB (MySQL, MariaDB) needs one writer at a time at a key no row holds yet. Writers
that wait on the INSERT of an uncommitted key take shared locks on it; once that
transaction ends, two of them that go on to insert, or to lock the row they found,
each wait for the other's shared lock: a deadlock, which rolls back a caller's whole
transaction (a retry inside a savepoint cannot save it). Locking the key's row first
is not enough: when its holder rolls back, the writers that waited for it insert at
once and the same happens among them (three waiting writers: a deadlock in every
round). So on InnoDB a writer of a key no row holds first locks the key's slot, a row
of ``celery_outbox_dedup_slot`` that always exists (a hash of the key picks one of
4,096), until its transaction ends: the writers of a key queue there with exclusive
locks, and none waits on an uncommitted row of the key. Every wait is a row lock
InnoDB sees, so a deadlock between callers (two keys taken in crossed order) is found
at once and ends one transaction, as on PostgreSQL; a named lock (``GET_LOCK``, until
0.2) hid such waits, and every writer involved hung until its timeout (#45).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from django.db import IntegrityError, transaction

from ..envelope import Envelope
from .base import StoreBase
from .dialects import DEDUP_SLOT_TABLE, DEDUP_SLOTS, DEDUP_TABLE, MESSAGE_TABLE


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
            found = None
            if dialect.duplicates_deadlock and self._visible(key):
                # A row this transaction sees (committed, or its own): locking it
                # never waits on an insert, so the slot is not needed.
                found = self._holder(key)
            if found is None:
                if dialect.duplicates_deadlock:
                    self._lock_slot(key)
                found = self._take(key, task_id, until_sql, until_params)
                if found is None:
                    return None
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

    def _take(
        self, key: str, task_id: str, until_sql: str, until_params: list[Any]
    ) -> tuple[str, bool] | None:
        """Insert ``key`` for ``task_id`` (None), or find the row that holds it, locked.

        On InnoDB, under the key's slot, the row is locked first: an exclusive wait
        behind writers that lock a committed row directly, never the shared lock a
        refused INSERT takes (which, asking for the exclusive one next, deadlocks with
        them).
        """
        found = self._holder(key) if self.dialect.duplicates_deadlock else None
        while found is None:
            if self._insert(key, task_id, until_sql, until_params):
                return None
            found = self._holder(key)  # a concurrent writer took it first
        return found

    def _lock_slot(self, key: str) -> None:
        """On InnoDB, lock the slot of ``key`` until the caller's transaction ends.

        Writers of one key queue for it with exclusive locks, which a rollback hands
        to the next one; every uncommitted row of the key is its holder's, so no
        writer waits on one. A slot row found missing (a table emptied by hand) is
        inserted: the writers of that slot are then safe again once it commits.
        """
        slot = _slot(key)
        select = f"SELECT slot FROM {DEDUP_SLOT_TABLE} WHERE slot = %s FOR UPDATE"
        with self.connection.cursor() as cursor:
            cursor.execute(select, [slot])
            if cursor.fetchone() is not None:
                return
            cursor.execute(
                f"INSERT IGNORE INTO {DEDUP_SLOT_TABLE} (slot) VALUES (%s)", [slot]
            )
            cursor.execute(select, [slot])

    def _visible(self, key: str) -> bool:
        """Whether this transaction sees a row of ``key`` (a read that locks nothing)."""
        with self.connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {DEDUP_TABLE} WHERE dedup_key = %s", [key])
            return cursor.fetchone() is not None

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


def _slot(key: str) -> int:
    """The slot of ``key``: the same in every process, whatever its hash seed."""
    digest = hashlib.sha1(key.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:4], "big") % DEDUP_SLOTS
