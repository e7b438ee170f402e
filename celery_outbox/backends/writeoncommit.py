"""Write the outbox rows of a transaction in its ``COMMIT``'s round trip (experimental).

With a stock backend every ``send_task`` inside ``atomic()`` costs one INSERT round
trip to the database. :class:`WriteOnCommitMixin`, mixed into a PostgreSQL
``DatabaseWrapper`` (``ENGINE = "celery_outbox.backends.postgresql"``), buffers those
rows on the connection instead and writes them:

* before the next statement Django runs on the connection, so everything the
  transaction reads afterwards (counts, the pytest plugin, another query) sees them;
* at commit, as ``INSERT ...; COMMIT`` in one simple-protocol message: one round trip
  fewer per transaction, whatever the number of tasks. If the INSERT fails the
  server skips the COMMIT, Django rolls the transaction back and raises;
* never, when the transaction or the savepoint they were sent in rolls back.

The rows are written in the caller's transaction either way; only the moment the
INSERT reaches the server moves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError
from django.db.backends.postgresql.psycopg_any import is_psycopg3
from django.db.backends.utils import debug_transaction

from ..store.buffer import RowBuffer
from ..store.notify import HINTS
from ..store.store import OutboxWriter

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    _Wrapper = BaseDatabaseWrapper
else:
    _Wrapper = object


class WriteOnCommitMixin(_Wrapper):
    """A ``DatabaseWrapper`` mixin that sends buffered outbox rows with the next statement or ``COMMIT``.

    Put it first: ``class DatabaseWrapper(WriteOnCommitMixin, postgis.DatabaseWrapper)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox_row_buffer = RowBuffer()
        #: The transaction's open savepoints, oldest first (Django's ``savepoint_ids``
        #: counts only those of ``atomic()``).
        self._outbox_savepoints: list[str] = []
        #: A write of buffered rows that failed in this transaction and was not rolled
        #: back since: (how many savepoints were open then, what went wrong).
        self._outbox_failure: tuple[int, str] | None = None
        # First in the list, so it runs before any wrapper the application adds.
        self.execute_wrappers.insert(0, self._write_buffered_rows_first)

    def write_buffered_rows(self) -> None:
        """Send the buffered rows now, in a statement of their own."""
        envelopes, notify = self.outbox_row_buffer.take()
        if envelopes:
            try:
                OutboxWriter(self.alias).write(envelopes, notify=notify)
            except Exception as exc:
                # The error reaches whatever statement came next (a SAVEPOINT, a
                # query), which the caller may catch and carry on from. PostgreSQL
                # aborted the transaction; its COMMIT would roll it back without a
                # word. Remember, so that the commit says so instead.
                self._outbox_failure = (len(self._outbox_savepoints), repr(exc))
                raise

    def connect(self) -> None:
        # A new session continues no transaction: nothing buffered may travel into it.
        self._outbox_forget_transaction()
        super().connect()

    def _outbox_forget_transaction(self) -> None:
        self.outbox_row_buffer.clear()
        self._outbox_savepoints.clear()
        self._outbox_failure = None

    def _set_autocommit(self, autocommit: bool) -> None:
        if autocommit and self.outbox_row_buffer:
            # Left over from a block that never committed (manual transactions): they
            # go into its transaction, which the driver then refuses to leave open,
            # as it would with the stock engine. Never into autocommit.
            self.write_buffered_rows()
        super()._set_autocommit(autocommit)  # type: ignore[misc]  # not in django-stubs

    def _write_buffered_rows_first(
        self,
        execute: Callable[..., Any],
        sql: Any,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        if self.outbox_row_buffer:
            self.write_buffered_rows()
        return execute(sql, params, many, context)

    def _commit(self) -> None:
        failure = self._outbox_failure
        if failure is not None and self.connection is not None:
            # Django rolls back after a DatabaseError from the commit, then raises it.
            raise DatabaseError(
                f"The outbox rows of this transaction could not be written "
                f"({failure[1]}) and the error was caught inside the transaction, "
                f"which PostgreSQL had aborted. Nothing was committed: the "
                f"transaction was rolled back. Let the error end the transaction, or "
                f"catch it outside an atomic() block of its own."
            )
        self._outbox_savepoints.clear()
        if not self.outbox_row_buffer or self.connection is None:
            super()._commit()  # type: ignore[misc]  # not in django-stubs
            return
        if not is_psycopg3:
            # psycopg2 keeps its own idea of the transaction: one more round trip.
            self.write_buffered_rows()
            super()._commit()  # type: ignore[misc]
            return
        from psycopg import ClientCursor  # psycopg 3 only, which is_psycopg3 checked

        envelopes, notify = self.outbox_row_buffer.take()
        # Decided now, not when the rows were enqueued: a hint another transaction
        # committed since then (or one that rolled back) is what counts.
        notify = notify and HINTS.due()
        store = OutboxWriter(self.alias)
        try:
            with self.wrap_database_errors, ClientCursor(self.connection) as cursor:
                # The driver merges the values into the text (client-side binding):
                # with no parameters left, psycopg sends it with the simple query
                # protocol, which runs both statements.
                statement = (
                    cursor.mogrify(*store.insert_statement(envelopes, notify=notify))
                    + "; COMMIT"
                )
                with debug_transaction(self, statement):
                    cursor.execute(statement)
        except DatabaseError:
            raise
        except Exception as exc:
            # Nothing reached the server (the text could not even be built or
            # encoded). Django rolls back only after a DatabaseError: without one the
            # connection would stay inside this transaction.
            raise DatabaseError(
                f"The outbox rows could not be sent with the COMMIT: {exc!r}. "
                f"The transaction was rolled back."
            ) from exc
        if notify:
            HINTS.committed()
        # psycopg reads the transaction state from the server's reply: its commit()
        # is now a no-op, so Django's bookkeeping after _commit() stays as it is.

    def _rollback(self) -> None:
        self._outbox_forget_transaction()
        super()._rollback()  # type: ignore[misc]

    def _savepoint(self, sid: str) -> None:
        super()._savepoint(sid)  # type: ignore[misc]
        self._outbox_savepoints.append(sid)

    def _savepoint_rollback(self, sid: str) -> None:
        # SAVEPOINT went through the execute wrapper, which sent what was buffered then:
        # whatever is buffered now was sent inside this savepoint, and rolls back with it.
        self.outbox_row_buffer.clear()
        super()._savepoint_rollback(sid)  # type: ignore[misc]
        if sid in self._outbox_savepoints:
            kept = self._outbox_savepoints.index(sid) + 1  # it stays, emptied
            del self._outbox_savepoints[kept:]
            if self._outbox_failure is not None and self._outbox_failure[0] >= kept:
                self._outbox_failure = None  # it happened inside: rolled back too

    def _savepoint_commit(self, sid: str) -> None:
        super()._savepoint_commit(sid)  # type: ignore[misc]
        if sid in self._outbox_savepoints:
            del self._outbox_savepoints[self._outbox_savepoints.index(sid) :]

    def close(self) -> None:
        self._outbox_forget_transaction()
        super().close()
