"""Vendor-specific SQL fragments and the claim statement, one class per database family.

Every timestamp is taken from the database clock, never from the relay's, so relays
on hosts with drifting clocks still agree on leases and retry times.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from django.db.backends.base.base import BaseDatabaseWrapper

from ..exceptions import OutboxConfigurationError
from .notify import CHANNEL

T = TypeVar("T")

MESSAGE_TABLE = "celery_outbox_message"
DEAD_TABLE = "celery_outbox_deadletter"
RELAY_TABLE = "celery_outbox_relay"
DEDUP_TABLE = "celery_outbox_dedup_key"
DEDUP_SLOT_TABLE = "celery_outbox_dedup_slot"
#: The rows of DEDUP_SLOT_TABLE (migration 0014 writes them): a key's slot is a hash
#: of it modulo this, so two keys share a slot about once in this many pairs.
DEDUP_SLOTS = 4096
HISTORY_TABLE = "celery_outbox_history"
FLOW_TABLE = "celery_outbox_flow"
FLOW_RECORD_TABLE = "celery_outbox_flow_record"
FLOW_SLOT_TABLE = "celery_outbox_flow_slot"
#: Every table the ``celery_outbox`` migrations make.
TABLES = (
    MESSAGE_TABLE,
    DEAD_TABLE,
    RELAY_TABLE,
    DEDUP_TABLE,
    DEDUP_SLOT_TABLE,
    HISTORY_TABLE,
    FLOW_TABLE,
    FLOW_RECORD_TABLE,
)

#: Columns copied verbatim between the outbox and the dead-letter table.
MESSAGE_COLUMNS = (
    "task_id",
    "task_name",
    "queue",
    "exchange",
    "routing_key",
    "ordering_key",
    "payload_version",
    "body",
    "content_type",
    "content_encoding",
    "headers",
    "properties",
    "declare_queues",
    "arguments_preview",
    "log_context",
)

#: What the enqueue path (and a replay) writes: the message, then the row's state.
INSERT_COLUMNS = (
    *MESSAGE_COLUMNS,
    "attempts",
    "last_error",
    "created_at",
    "available_at",
)

#: The widest value each text column of a message holds, in characters (the models'
#: ``max_length``); the enqueue path refuses longer values at the call.
COLUMN_LIMITS = {
    "task_id": 255,
    "task_name": 255,
    "queue": 255,
    "exchange": 255,
    "routing_key": 255,
    "ordering_key": 255,
    "content_type": 128,
    "content_encoding": 64,
}

#: Since when a row has waited to be published: its ETA if it was scheduled
#: (``due_at``), else its enqueue.
WAITING_SINCE = "COALESCE(due_at, created_at)"

#: What a claim returns for each row, in this order. ``state`` tells a strict head
#: published again after its running lease (``running``) from a first publish.
CLAIM_COLUMNS = ("id", "attempts", *MESSAGE_COLUMNS, "state")


class Dialect:
    """SQL that differs between vendors. Parameters are always ``%s``."""

    vendor = ""
    #: Whether several relays can claim from the table at once.
    concurrent_claims = True
    #: Whether :meth:`insert` can carry a wake-up hint.
    notifies = False
    #: Whether writers that wait on the INSERT of one uncommitted key deadlock when
    #: it rolls back (InnoDB's shared locks on a duplicate): they lock the key first.
    duplicates_deadlock = False

    def now(self) -> str:
        """An SQL expression for the database's current UTC time.

        On PostgreSQL the start of the transaction (``now()``): one value for the
        whole statement, so an index serves a comparison with it, and close enough
        in the short transactions of a relay. A time a caller's transaction writes
        counts from :meth:`clock` instead.
        """
        raise NotImplementedError

    def clock(self) -> str:
        """The database's UTC time when the statement runs, however long its
        transaction has been open.

        What a due time written in a caller's transaction counts from (a scheduled
        row's ETA, a ``dedup_key``'s window): from :meth:`now`, a row written 20 s
        into a transaction on PostgreSQL would be due 20 s early. One value for the
        whole statement, as :meth:`now` (PostgreSQL's ``statement_timestamp()``);
        MySQL's and SQLite's current time is the statement's already.
        """
        return self.now()

    def exact(self, column: str) -> str:
        """``column`` compared character for character (case and accents count)."""
        return column

    def insert(self, insert_sql: str, notify: bool) -> str:
        """The enqueue INSERT, with a wake-up hint for the relay where the vendor has one."""
        return insert_sql

    def delete_waking(self, cursor: Any, where: str, params: Sequence[Any]) -> int:
        """Delete the outbox rows ``where`` selects, in one statement; how many went.

        Where the vendor has a wake-up hint, listening relays get it when at least
        one row went, once the statement's transaction commits.
        """
        cursor.execute(f"DELETE FROM {MESSAGE_TABLE} WHERE {where}", list(params))
        return int(cursor.rowcount)

    def after(self, seconds: float, *, clock: bool = False) -> tuple[str, list[Any]]:
        """SQL (and its parameters) for the database time ``seconds`` from now.

        ``clock``: from the statement's time (:meth:`clock`), not the transaction's.
        """
        return self.after_expr("%s", clock=clock), [self.delay_value(seconds)]

    def after_expr(self, delay_sql: str, *, clock: bool = False) -> str:
        """SQL for now plus a delay given as an SQL expression of :meth:`delay_value` values.

        ``clock``: from the statement's time (:meth:`clock`), not the transaction's.
        """
        raise NotImplementedError

    def delay_value(self, seconds: float) -> Any:
        """A delay as this vendor's :meth:`after_expr` wants it."""
        raise NotImplementedError

    def age_seconds(self, column: str, *, clock: bool = False) -> str:
        """SQL for how many seconds ago the timestamp in ``column`` was.

        ``clock``: counted to the statement's time (:meth:`clock`), not the
        transaction's.
        """
        raise NotImplementedError

    def insert_missing(self, table: str, key: str, columns: Sequence[str]) -> str:
        """An INSERT of one row (``%s`` per column) that does nothing when a row
        with its ``key`` exists, even one another transaction is inserting."""
        values = placeholders(columns)
        return (
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({values}) "
            f"ON CONFLICT ({key}) DO NOTHING"
        )

    def among(self, column: str, ids: Sequence[int]) -> tuple[str, list[Any]]:
        """SQL (and parameters) for ``column`` being one of ``ids``."""
        return f"{column} IN ({placeholders(ids)})", list(ids)

    def claim(
        self,
        cursor: Any,
        limit: int,
        lease_seconds: float,
        token: str,
        task_ids: Sequence[str] = (),
        holder: str | None = None,
    ) -> list[Sequence[Any]]:
        """Lease up to ``limit`` due rows to ``token`` and return them (CLAIM_COLUMNS).

        With ``task_ids``, only rows of those tasks are considered. ``holder`` is the
        claiming relay's heartbeat id (None: no heartbeat, the lease alone counts).
        """
        after_sql, after_params = self.after(lease_seconds)
        columns = self.claim_columns()
        cursor.execute(
            f"UPDATE {MESSAGE_TABLE} SET lease_token = %s, holder = %s, "
            f"available_at = {after_sql} "
            f"WHERE {self._claimed_rows(task_ids)} RETURNING {columns}",
            [token, holder, *after_params, *task_ids, limit],
        )
        return list(cursor.fetchall())

    def claim_columns(self) -> str:
        """CLAIM_COLUMNS, then the row's age in seconds (for commit-to-publish latency).

        A scheduled task's age counts from its ETA (:data:`WAITING_SINCE`).
        """
        return ", ".join(CLAIM_COLUMNS) + f", {self.age_seconds(WAITING_SINCE)}"

    def _due_where(self, task_ids: Sequence[str]) -> str:
        """Due rows of the table aliased ``d``: unkeyed, or the head of their key.

        A keyed row waits while a row of its key with a lower id exists (leased,
        retrying, running or blocked): one row per key is in flight at a time. An
        unkeyed row stops at ``IS NULL``; the index on (ordering_key, id) serves
        the rest. MySQL reads the subquery from the statement's snapshot (it locks
        nothing there), so a head another claim holds still counts.
        """
        where = (
            f"available_at <= {self.now()} AND (d.ordering_key IS NULL OR NOT EXISTS "
            f"({self._older_in_key()}))"
        )
        if task_ids:
            where += f" AND task_id IN ({placeholders(task_ids)})"
        return where

    def _older_in_key(self) -> str:
        """The subquery that finds a row of ``d``'s key with a lower id."""
        return (
            f"SELECT 1 FROM {MESSAGE_TABLE} o WHERE o.ordering_key = d.ordering_key "
            f"AND o.id < d.id"
        )

    def next_due_sql(self) -> str:
        """Seconds until the next row falls due, as the negative age of the first
        ``available_at`` index entry after now (NULL when none); no parameters."""
        return (
            f"SELECT {self.age_seconds('MIN(available_at)')} FROM {MESSAGE_TABLE} "
            f"WHERE available_at > {self.now()}"
        )

    def due_ids_sql(self) -> str:
        """The claim's selection of due rows (what the index must serve), one ``%s``: limit."""
        return self._due_ids_sql()

    def _claimed_rows(self, task_ids: Sequence[str]) -> str:
        """The claim's UPDATE condition: the rows the selection picks."""
        return f"id IN ({self._due_ids_sql(task_ids)})"

    def _due_ids_sql(self, task_ids: Sequence[str] = (), select: str = "id") -> str:
        return (
            f"SELECT {select} FROM {MESSAGE_TABLE} d WHERE {self._due_where(task_ids)} "
            f"ORDER BY available_at, id LIMIT %s"
        )


class PostgresDialect(Dialect):
    vendor = "postgresql"
    notifies = True

    def insert(self, insert_sql: str, notify: bool) -> str:
        if not notify:
            return insert_sql
        # A data-modifying CTE runs even though the SELECT ignores it: one round trip,
        # and PostgreSQL delivers the notification only if the transaction commits.
        return f"WITH inserted AS ({insert_sql} RETURNING 1) SELECT pg_notify('{CHANNEL}', '')"

    def delete_waking(self, cursor: Any, where: str, params: Sequence[Any]) -> int:
        # One notification per deleted row, which PostgreSQL folds into one (same
        # channel, same payload, one transaction); none when nothing went.
        cursor.execute(
            f"WITH gone AS (DELETE FROM {MESSAGE_TABLE} WHERE {where} RETURNING 1) "
            f"SELECT COUNT(*) FROM (SELECT pg_notify('{CHANNEL}', '') FROM gone) woken",
            list(params),
        )
        return int(cursor.fetchone()[0])

    def now(self) -> str:
        return "now()"

    def clock(self) -> str:
        return "statement_timestamp()"

    def after_expr(self, delay_sql: str, *, clock: bool = False) -> str:
        start = self.clock() if clock else self.now()
        return f"{start} + ({delay_sql}) * interval '1 second'"

    def delay_value(self, seconds: float) -> Any:
        return float(seconds)

    def age_seconds(self, column: str, *, clock: bool = False) -> str:
        start = self.clock() if clock else self.now()
        return f"EXTRACT(EPOCH FROM {start} - {column})"

    def among(self, column: str, ids: Sequence[int]) -> tuple[str, list[Any]]:
        # One array parameter: the statement text stays the same for every batch, so
        # the driver and the server reuse its parsing instead of 500 placeholders.
        return f"{column} = ANY(%s)", [list(ids)]

    def _claimed_rows(self, task_ids: Sequence[str]) -> str:
        # The rows the selection locked, by their address: one TID scan, whatever the
        # statistics say. A queue table vacuumed while nearly empty is one row to the
        # planner until the next ANALYZE; "id IN (selection)" then ran the selection
        # once per row of the table (claiming every due row, not a batch) or found each
        # id by reading the whole (ordering_key, id) index. A locked row keeps its
        # address until this statement changes it.
        return f"ctid = ANY(ARRAY({self._due_ids_sql(task_ids, 'ctid')}))"

    def _due_ids_sql(self, task_ids: Sequence[str] = (), select: str = "id") -> str:
        return super()._due_ids_sql(task_ids, select) + " FOR UPDATE SKIP LOCKED"

    def _older_in_key(self) -> str:
        # The nearest lower id of the key, found by reading the (ordering_key, id)
        # index backwards from d.id. The plain NOT EXISTS reads it forwards from the
        # key's lowest entry, over every entry of the key's deleted rows that vacuum
        # has not removed yet: a deep key that drains pays more with every claim. The
        # derived table keeps PostgreSQL from dropping the ORDER BY ... LIMIT 1.
        return (
            f"SELECT 1 FROM (SELECT o.id FROM {MESSAGE_TABLE} o "
            f"WHERE o.ordering_key = d.ordering_key AND o.id < d.id "
            f"ORDER BY o.id DESC LIMIT 1) nearest"
        )


class MySQLDialect(Dialect):
    """MySQL 8 and MariaDB >= 10.6: no UPDATE ... RETURNING, so select then update."""

    vendor = "mysql"
    duplicates_deadlock = True

    def exact(self, column: str) -> str:
        # The default collations ignore case (and, in MariaDB, trailing spaces).
        return f"CAST({column} AS BINARY)"

    def now(self) -> str:
        return "UTC_TIMESTAMP(6)"

    def after_expr(self, delay_sql: str, *, clock: bool = False) -> str:
        # UTC_TIMESTAMP() is the statement's start, in a transaction or not.
        return f"UTC_TIMESTAMP(6) + INTERVAL ({delay_sql}) MICROSECOND"

    def delay_value(self, seconds: float) -> Any:
        return round(seconds * 1_000_000)

    def age_seconds(self, column: str, *, clock: bool = False) -> str:
        return f"TIMESTAMPDIFF(MICROSECOND, {column}, UTC_TIMESTAMP(6)) / 1000000.0"

    def insert_missing(self, table: str, key: str, columns: Sequence[str]) -> str:
        return (
            f"INSERT IGNORE INTO {table} ({', '.join(columns)}) "
            f"VALUES ({placeholders(columns)})"
        )

    def claim(
        self,
        cursor: Any,
        limit: int,
        lease_seconds: float,
        token: str,
        task_ids: Sequence[str] = (),
        holder: str | None = None,
    ) -> list[Sequence[Any]]:
        # The caller holds a transaction: the locks of SELECT ... FOR UPDATE last
        # until the UPDATE below has stamped the lease.
        columns = self.claim_columns()
        cursor.execute(
            f"SELECT {columns} FROM {MESSAGE_TABLE} d WHERE {self._due_where(task_ids)} "
            f"ORDER BY available_at, id LIMIT %s FOR UPDATE SKIP LOCKED",
            [*task_ids, limit],
        )
        rows = list(cursor.fetchall())
        if rows:
            after_sql, after_params = self.after(lease_seconds)
            ids = [row[0] for row in rows]
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET lease_token = %s, holder = %s, "
                f"available_at = {after_sql} WHERE id IN ({placeholders(ids)})",
                [token, holder, *after_params, *ids],
            )
        return rows


class SQLiteDialect(Dialect):
    """SQLite: one writer at a time, so one relay (enforced by the relay lock)."""

    vendor = "sqlite"
    concurrent_claims = False
    _FORMAT = "'%%Y-%%m-%%d %%H:%%M:%%f'"

    def now(self) -> str:
        return f"strftime({self._FORMAT}, 'now')"

    def after_expr(self, delay_sql: str, *, clock: bool = False) -> str:
        # 'now' is the statement's time (one value per sqlite3_step()).
        return f"strftime({self._FORMAT}, 'now', {delay_sql})"

    def delay_value(self, seconds: float) -> Any:
        return f"{seconds:+.6f} seconds"

    def age_seconds(self, column: str, *, clock: bool = False) -> str:
        return f"(julianday('now') - julianday({column})) * 86400.0"


def placeholders(values: Sequence[Any]) -> str:
    """``%s, %s, ...`` for an IN list."""
    return ", ".join(["%s"] * len(values))


#: Rows per statement where each row gets a value of its own (:func:`case_by_id`).
#: The database reads a ``CASE`` over the statement's ids for every row, so one
#: statement costs the square of its rows (16,000 refusals: 8 s on PostgreSQL); a
#: fixed chunk keeps a settlement linear in its rows.
CASE_CHUNK = 100


def case_by_id(values: Mapping[int, Any]) -> tuple[str, list[Any]]:
    """``CASE id WHEN .. THEN .. END`` picking each row's value, with its parameters.

    Keep ``values`` to :data:`CASE_CHUNK` ids (:func:`chunked`).
    """
    whens = " ".join(["WHEN %s THEN %s"] * len(values))
    params = [item for pair in values.items() for item in pair]
    return f"CASE id {whens} END", params


def chunked(items: Sequence[T], size: int = CASE_CHUNK) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def dialect_for(connection: BaseDatabaseWrapper) -> Dialect:
    """The dialect for a Django connection; refuses databases that cannot claim safely."""
    vendor = connection.vendor
    if vendor == "postgresql":
        return PostgresDialect()
    if vendor == "mysql":
        if not connection.features.has_select_for_update_skip_locked:
            raise OutboxConfigurationError(
                f"Database alias {connection.alias!r} does not support SELECT ... FOR UPDATE "
                "SKIP LOCKED, which the relay needs: use MySQL >= 8.0.1 or MariaDB >= 10.6."
            )
        return MySQLDialect()
    if vendor == "sqlite":
        return SQLiteDialect()
    raise OutboxConfigurationError(
        f"Database alias {connection.alias!r} uses {vendor!r}; celery-outbox supports "
        "PostgreSQL, MySQL 8 / MariaDB >= 10.6 and SQLite."
    )
