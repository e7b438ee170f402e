"""What every part of the store shares: the alias, its connection and dialect, error translation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.db import DatabaseError, InterfaceError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from ..exceptions import OutboxConfigurationError, OutboxDatabaseError
from .dialects import TABLES, Dialect, dialect_for
from .notify import CHANNEL

#: The attribute of a Django connection object that holds its :class:`Dialect`.
_DIALECT = "_celery_outbox_dialect"


class StoreBase:
    """The outbox tables on one database alias.

    ``holder`` is the heartbeat id of the relay this store claims for (see
    :mod:`.relays`); None claims without one (publish-on-commit, commands).
    """

    def __init__(self, alias: str, *, holder: str | None = None) -> None:
        self.alias = alias
        self.holder = holder

    @property
    def connection(self) -> BaseDatabaseWrapper:
        """The Django connection of the outbox alias."""
        return connections[self.alias]

    @property
    def dialect(self) -> Dialect:
        """SQL for this alias's vendor (on MySQL this asks the server its version).

        Kept on the Django connection object, which lives as long as its settings.
        """
        connection = self.connection
        found: Dialect | None = connection.__dict__.get(_DIALECT)
        if found is None:
            with self._translated():
                found = dialect_for(connection)
            connection.__dict__[_DIALECT] = found
        return found

    def reset_connection(self) -> None:
        """Drop a connection that failed, so that the next statement reconnects."""
        connection = self.connection
        if connection.in_atomic_block:
            return
        with contextlib.suppress(Exception):
            connection.close()

    def _wake_relays(self, cursor: Any, changed: int) -> None:
        """On PostgreSQL, wake listening relays at commit when rows fell due."""
        if changed and self.dialect.notifies:
            cursor.execute(f"SELECT pg_notify('{CHANNEL}', '')", [])

    def _for_update(self) -> str:
        """`` FOR UPDATE`` where the vendor has row locks (SQLite has one writer)."""
        connection = self.connection
        if not connection.features.has_select_for_update:
            return ""
        return " " + str(connection.ops.for_update_sql())

    def _delete_in_chunks(
        self,
        select: str,
        params: Sequence[Any],
        delete: Callable[[list[Any]], tuple[str, Sequence[Any]]],
        chunk_size: int,
    ) -> int:
        """Delete in chunks, each in a transaction of its own; how many rows went.

        ``select`` (its last placeholder: the chunk size) finds a chunk's keys,
        ``delete(keys)`` gives the statement that deletes them; a chunk shorter than
        ``chunk_size`` is the last.
        """
        deleted = 0
        while True:
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                cursor.execute(select, [*params, chunk_size])
                keys = [row[0] for row in cursor.fetchall()]
                if keys:
                    cursor.execute(*delete(keys))
                    deleted += int(cursor.rowcount)
            if len(keys) < chunk_size:
                return deleted

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except (DatabaseError, InterfaceError) as exc:
            missing = self._missing_tables()
            if missing:
                raise OutboxConfigurationError(
                    f"table missing on outbox database {self.alias!r}: "
                    f"{', '.join(missing)}. Run: python manage.py migrate "
                    f"celery_outbox --database {self.alias}"
                ) from exc
            raise OutboxDatabaseError(
                f"outbox database {self.alias!r}: {type(exc).__name__}: {exc}"
            ) from exc

    def _missing_tables(self) -> list[str]:
        """The outbox tables the database lacks, when it can say (after an error)."""
        return missing_tables(self.connection, TABLES)


def missing_tables(connection: BaseDatabaseWrapper, tables: Sequence[str]) -> list[str]:
    """Which of ``tables`` the database lacks, when it can say (after an error).

    Asked only outside a transaction: inside one, PostgreSQL refuses every
    statement after an error.
    """
    if connection.in_atomic_block:
        return []
    try:
        present = set(connection.introspection.table_names())
    except Exception:  # unreachable, or worse: the first error says enough
        return []
    return [table for table in tables if table not in present]
