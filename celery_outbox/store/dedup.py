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
round). So on InnoDB the step that finds or inserts a key no row holds runs under a
named lock of that key (``GET_LOCK``, released as soon as the step is done): the
writers of a key queue there, and at most one waits on the key's row at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

from django.db import IntegrityError, OperationalError, transaction

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
            found = None
            if dialect.duplicates_deadlock and self._visible(key):
                # A row this transaction sees (committed, or its own): locking it
                # never waits on an insert, so no named lock is needed.
                found = self._holder(key)
            if found is None:
                with self._one_writer(key):
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

        On InnoDB the row is locked first: an exclusive wait for a writer that has
        not committed yet, never the shared lock a refused INSERT takes.
        """
        found = self._holder(key) if self.dialect.duplicates_deadlock else None
        while found is None:
            if self._insert(key, task_id, until_sql, until_params):
                return None
            found = self._holder(key)  # a concurrent writer took it first
        return found

    @contextlib.contextmanager
    def _one_writer(self, key: str) -> Iterator[None]:
        """On InnoDB, hold the named lock of ``key`` while the block runs.

        Writers of one key queue for it (as long as InnoDB lets a row lock wait);
        locks of other keys are others. Released when the block ends, whatever
        happens: the key's row, once inserted, holds the key for the transaction.
        """
        if not self.dialect.duplicates_deadlock:
            yield
            return
        name = _lock_name(str(self.connection.settings_dict["NAME"]), key)
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, @@innodb_lock_wait_timeout)", [name])
            row = cursor.fetchone()
        if row is None or row[0] != 1:
            raise OperationalError(
                f"waited longer than innodb_lock_wait_timeout for dedup_key {key!r} "
                f"(named lock {name!r}): another transaction holding it runs long"
            )
        try:
            yield
        finally:
            with self.connection.cursor() as cursor:
                cursor.execute("SELECT RELEASE_LOCK(%s)", [name])

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


def _lock_name(database: str, key: str) -> str:
    """The named lock of ``key`` in ``database``: named locks are server-wide, and
    their names at most 64 characters long."""
    digest = hashlib.sha1(f"{database}\x00{key}".encode(), usedforsecurity=False)
    return f"celery_outbox.dedup.{digest.hexdigest()}"
