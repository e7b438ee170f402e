"""The enqueue's writes and the relay's claims and settlements on the outbox table.

:class:`OutboxWriter` is what the enqueue path writes (:class:`~.protocol.EnqueueStore`),
:class:`RelayQueries` what a relay claims and settles (:class:`~.protocol.RelayStore`);
:mod:`.operator` holds the operator queries, :mod:`.dialects` the vendor SQL.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from django.db import transaction

from ..caches import BoundedCache, bounded_cache
from ..envelope import (
    PAYLOAD_VERSION,
    Envelope,
    JsonObject,
    StoredMessage,
    check_payload_version,
    dump_json,
    dump_log_context,
    json_text,
    load_json,
    load_log_context,
)
from ..exceptions import (
    OutboxConfigurationError,
    UnsupportedPayloadVersion,
)
from ..outcomes import Action, Decision, Settlement
from ..queues import is_spec
from ..states import DEAD
from ..text import check_text, storable
from .base import StoreBase
from .buffer import ROW_BUFFER, RowBuffer
from .dialects import (
    COLUMN_LIMITS,
    DEAD_TABLE,
    INSERT_COLUMNS,
    MESSAGE_COLUMNS,
    MESSAGE_TABLE,
    Dialect,
    case_by_id,
    chunked,
    placeholders,
)
from .history import HistoryWriter
from .leftover import read_leftover
from .notify import HINTS, remember_hint
from .ordering import RUNNING, KeyedClaims
from .types import (
    Claim,
    Leftover,
    SettleReport,
)

logger = logging.getLogger("celery_outbox.store")


class OutboxWriter(StoreBase):
    """What the enqueue path writes: outbox rows, in the caller's transaction."""

    def insert(self, envelopes: Sequence[Envelope], *, notify: bool = False) -> None:
        """Write messages in the caller's current transaction, in one statement.

        With ``notify`` on PostgreSQL the same statement tells listening relays, unless
        a hint of this process committed just now (:class:`.notify.HintCoalescer`). On
        a connection of the write-on-commit engine (:mod:`celery_outbox.backends`)
        inside ``atomic()``, the rows are buffered and written before the connection's
        next statement or in its ``COMMIT``'s round trip, where the hint is decided.
        """
        if not envelopes:
            return
        for envelope in envelopes:
            check_fits(envelope)
        if any(envelope.due_in is not None for envelope in envelopes):
            envelopes = self._bury_expired(envelopes)
            if not envelopes:
                return
        connection = self.connection
        buffer: RowBuffer | None = getattr(connection, ROW_BUFFER, None)
        if (
            buffer is not None
            and connection.in_atomic_block
            and not connection.closed_in_transaction  # the cursor below says why
        ):
            buffer.add(envelopes, notify)
            return
        self.write(envelopes, notify=notify)

    def write(self, envelopes: Sequence[Envelope], *, notify: bool) -> None:
        """Send the INSERT of checked messages now, with bound parameters.

        ``notify`` asks for the wake-up hint, which is left out while one of this
        process committed just now. More rows than the database takes parameters
        for in one statement are written in several.
        """
        notify = notify and self.dialect.notifies and HINTS.due()
        connection = self.connection
        limit = connection.features.max_query_params  # None: no limit
        size = _ROWS_PER_INSERT
        if limit:
            size = max(1, min(size, limit // len(MESSAGE_COLUMNS)))
        with connection.cursor() as cursor:
            for start in range(0, len(envelopes), size):
                chunk = envelopes[start : start + size]
                # One hint is enough: on the last statement.
                last = start + size >= len(envelopes)
                cursor.execute(*self.insert_statement(chunk, notify=notify and last))
        if notify:
            remember_hint(connection)

    def insert_statement(
        self, envelopes: Sequence[Envelope], *, notify: bool
    ) -> tuple[str, list[Any]]:
        """The one INSERT (and its parameters) that writes ``envelopes``."""
        dialect = self.dialect
        if any(envelope.due_in is not None for envelope in envelopes):
            return self._scheduled_statement(envelopes, notify=notify)
        now = dialect.now()
        row = f"({placeholders(MESSAGE_COLUMNS)}, 0, '', {now}, {now})"
        params: list[Any] = []
        for envelope in envelopes:
            params.extend(message_values(envelope))
        sql = dialect.insert(
            f"{_INSERT_HEAD} VALUES " + ", ".join([row] * len(envelopes)), notify
        )
        return sql, params

    def _scheduled_statement(
        self, envelopes: Sequence[Envelope], *, notify: bool
    ) -> tuple[str, list[Any]]:
        """The INSERT of messages some of which are scheduled: due at their ETA.

        ``available_at`` and ``due_at`` are the ETA on the database clock (the
        statement's time plus the seconds the call had left), so relays and the
        worker's ``eta`` agree however the caller's clock drifts from the
        database's, and however long the caller's transaction has been open.
        """
        dialect = self.dialect
        now = dialect.now()
        at_once = f"({placeholders(MESSAGE_COLUMNS)}, 0, '', {now}, {now}, NULL)"
        later = dialect.after_expr("%s", clock=True)
        scheduled = f"({placeholders(MESSAGE_COLUMNS)}, 0, '', {now}, {later}, {later})"
        rows: list[str] = []
        params: list[Any] = []
        written_at = time.monotonic()
        for envelope in envelopes:
            params.extend(message_values(envelope))
            if envelope.due_in is None:
                rows.append(at_once)
            else:
                rows.append(scheduled)
                params.extend([dialect.delay_value(left(envelope, written_at))] * 2)
        sql = f"{_SCHEDULED_HEAD} VALUES " + ", ".join(rows)
        return dialect.insert(sql, notify), params

    def _bury_expired(self, envelopes: Sequence[Envelope]) -> list[Envelope]:
        """Write the messages that expire before their ETA to the dead letters, in
        the caller's transaction, each with its reason; returns the others."""
        dead = [envelope for envelope in envelopes if envelope.dead_reason]
        if not dead:
            return list(envelopes)
        now = self.dialect.now()
        row = f"(0, {placeholders(MESSAGE_COLUMNS)}, 0, %s, {now}, {now})"
        params: list[Any] = []
        for envelope in dead:
            params.extend([*message_values(envelope), storable(envelope.dead_reason)])
        logger.warning(
            "%d task(s) written to the dead letters, never published: %s",
            len(dead),
            "; ".join(f"{e.task_name} [{e.task_id}] {e.dead_reason}" for e in dead),
        )
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {DEAD_TABLE} (original_id, {', '.join(MESSAGE_COLUMNS)}, "
                f"attempts, last_error, created_at, dead_at) VALUES "
                + ", ".join([row] * len(dead)),
                params,
            )
        return [envelope for envelope in envelopes if not envelope.dead_reason]


class RelayQueries(KeyedClaims, HistoryWriter):
    """What a relay claims and settles, each write fenced by the lease token.

    ``holder`` is the heartbeat id the claims are made for (None: publish-on-commit);
    ``history`` writes each settled message's history (None: ``CELERY_OUTBOX_HISTORY``).
    """

    @property
    def concurrent_claims(self) -> bool:
        """Whether several claims may run at once (row locks: not SQLite)."""
        return self.dialect.concurrent_claims

    def claim(
        self, limit: int, lease_seconds: float, *, task_ids: Sequence[str] = ()
    ) -> Claim:
        """Lease up to ``limit`` due rows, oldest first, skipping rows other relays hold.

        ``task_ids`` restricts the claim to those tasks' rows (publish-on-commit).
        """
        token = uuid.uuid4().hex
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            rows = self.dialect.claim(
                cursor, limit, lease_seconds, token, task_ids, self.holder
            )
            # Keyed rows: a run after each head, then coalescing (celery_outbox.ordering).
            rows, coalesced = self.extend_claim(
                cursor, list(rows), limit, lease_seconds, token
            )
        messages: list[StoredMessage] = []
        unreadable: list[Decision] = []
        for row in sorted(rows, key=lambda r: int(r[0])):
            try:
                messages.append(_stored_message(row))
            except UnsupportedPayloadVersion as exc:
                logger.error("%s", exc)
                unreadable.append(
                    Decision(int(row[0]), Action.DEAD_LETTER, 0.0, str(exc))
                )
            except (ValueError, TypeError) as exc:
                # Edited by hand or damaged: dead-lettered as it is, so that it stops
                # no batch and can be fixed and replayed from there.
                error = (
                    f"Outbox row {row[0]} cannot be read ({exc}); it was dead-lettered "
                    f"unchanged. Correct the row in the dead-letter table and replay it."
                )
                logger.error("%s", error)
                unreadable.append(Decision(int(row[0]), Action.DEAD_LETTER, 0.0, error))
        return Claim(token, tuple(messages), tuple(unreadable), coalesced)

    def settle(self, token: str, settlement: Settlement) -> SettleReport:
        """Apply a batch's decisions in one transaction, each write fenced by the lease token."""
        if not settlement.size:
            return SettleReport()
        dialect = self.dialect
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            if self.history:  # first: it reads the rows the statements below change
                self.record_settlement(
                    cursor,
                    token,
                    [*settlement.delete, *(d.message_id for d in settlement.hold)],
                    [(d.message_id, d.error) for d in settlement.retry],
                    [(d.message_id, d.error) for d in settlement.block],
                )
            deleted = self._delete(cursor, dialect, token, settlement.delete)
            retried = self._requeue(
                cursor, dialect, token, settlement.retry, count=True
            )
            released = self._requeue(
                cursor, dialect, token, settlement.release, count=False
            )
            dead = self._dead_letter(cursor, dialect, token, settlement.dead_letter)
            held = self._hold_running(cursor, dialect, token, settlement.hold)
            blocked = self._block_heads(cursor, dialect, token, settlement.block)
        report = SettleReport(deleted, retried, dead, released, held, blocked)
        # A held head may be gone already: its worker can finish before this commit.
        if (deleted, retried, dead, released, blocked) != (
            len(settlement.delete),
            len(settlement.retry),
            len(settlement.dead_letter),
            len(settlement.release),
            len(settlement.block),
        ):
            logger.warning(
                "Lease %s was lost for some rows (another relay may have claimed them): "
                "asked %s, changed %s",
                token,
                settlement,
                report,
            )
        return report

    def seconds_until_due(self) -> float | None:
        """Seconds until the next row not yet due falls due; None when none waits.

        One read of the first ``available_at`` index entry after now, however many
        rows are scheduled: an idle relay wakes then instead of at its next poll.
        """
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(self.dialect.next_due_sql(), [])
            row = cursor.fetchone()
        if row is None or row[0] is None:
            return None
        return max(0.0, -float(row[0]))

    def leftover(self) -> Leftover:
        """The rows no relay holds, by what they wait for (:mod:`.leftover`)."""
        with self._translated(), self.connection.cursor() as cursor:
            return read_leftover(cursor, self.dialect)

    def renew(self, token: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease on rows still held under ``token``; returns how many."""
        if not ids:
            return 0
        after_sql, after_params = self.dialect.after(lease_seconds)
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET available_at = {after_sql} "
                f"WHERE lease_token = %s AND id IN ({placeholders(ids)})",
                [*after_params, token, *ids],
            )
            return int(cursor.rowcount)

    def ping(self) -> None:
        """Raise :class:`OutboxDatabaseError` unless the outbox table answers.

        With history on, :class:`OutboxConfigurationError` without its table.
        """
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {MESSAGE_TABLE} WHERE 1 = 0", [])
            cursor.fetchall()
        self.check_history()

    @contextlib.contextmanager
    def relay_lock(self) -> Iterator[None]:
        """Held while a relay runs; on SQLite it refuses a second relay on the same file."""
        if self.dialect.concurrent_claims:
            yield
            return
        name = str(self.connection.settings_dict.get("NAME") or "")
        if not name or name == ":memory:" or name.startswith("file:"):
            yield
            return
        with _exclusive_file_lock(f"{name}.relay-lock"):
            yield

    def _delete(
        self, cursor: Any, dialect: Dialect, token: str, ids: Sequence[int]
    ) -> int:
        if not ids:
            return 0
        among_sql, among_params = dialect.among("id", ids)
        cursor.execute(
            f"DELETE FROM {MESSAGE_TABLE} WHERE lease_token = %s AND {among_sql}",
            [token, *among_params],
        )
        return int(cursor.rowcount)

    def _requeue(
        self,
        cursor: Any,
        dialect: Dialect,
        token: str,
        decisions: Sequence[Decision],
        *,
        count: bool,
    ) -> int:
        """Put rows back, each with its own delay and reason: a statement per chunk."""
        bump = "attempts = attempts + 1, " if count else ""
        changed = 0
        for chunk in chunked(decisions):
            ids = [d.message_id for d in chunk]
            errors_sql, errors = case_by_id(
                {d.message_id: storable(d.error) for d in chunk}
            )
            delays_sql, delays = case_by_id(
                {d.message_id: dialect.delay_value(d.delay) for d in chunk}
            )
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET {bump}last_error = {errors_sql}, "
                f"available_at = {dialect.after_expr(delays_sql)}, "
                f"lease_token = NULL, holder = NULL "
                f"WHERE lease_token = %s AND id IN ({placeholders(ids)})",
                [*errors, *delays, token, *ids],
            )
            changed += int(cursor.rowcount)
        return changed

    def _dead_letter(
        self, cursor: Any, dialect: Dialect, token: str, decisions: Sequence[Decision]
    ) -> int:
        """Move rows to the dead letters: lock the ones still ours, copy, delete.

        Locking first matters: ``INSERT ... SELECT`` does not lock its source rows, so
        without it a relay that re-claimed a row after its lease ended could publish
        it while we also dead-letter it.
        """
        if not decisions:
            return 0
        ids = [d.message_id for d in decisions]
        cursor.execute(
            f"SELECT id FROM {MESSAGE_TABLE} WHERE lease_token = %s "
            f"AND id IN ({placeholders(ids)}) ORDER BY id{self._for_update()}",
            [token, *ids],
        )
        held = [int(row[0]) for row in cursor.fetchall()]
        if not held:
            return 0
        reasons = {d.message_id: d.error for d in decisions}
        self.record_outbox(cursor, DEAD, held, errors=reasons, used=1)
        columns = ", ".join(MESSAGE_COLUMNS)
        for chunk in chunked(held):
            errors_sql, errors = case_by_id(
                {row_id: storable(reasons[row_id]) for row_id in chunk}
            )
            cursor.execute(
                f"INSERT INTO {DEAD_TABLE} (original_id, {columns}, attempts, "
                f"last_error, created_at, dead_at) SELECT id, {columns}, attempts + 1, "
                f"{errors_sql}, created_at, {dialect.now()} FROM {MESSAGE_TABLE} "
                f"WHERE id IN ({placeholders(chunk)}) ORDER BY id",
                [*errors, *chunk],
            )
        among_sql, among_params = dialect.among("id", held)
        cursor.execute(f"DELETE FROM {MESSAGE_TABLE} WHERE {among_sql}", among_params)
        return len(held)


@contextlib.contextmanager
def _exclusive_file_lock(path: str) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutboxConfigurationError(
                f"Another relay is already running on this SQLite database (lock file "
                f"{path}). SQLite supports one relay at a time; use PostgreSQL or "
                f"MySQL/MariaDB to run several."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


#: The enqueue INSERT up to its VALUES (the row layout of :func:`message_values`).
_INSERT_HEAD = f"INSERT INTO {MESSAGE_TABLE} ({', '.join(INSERT_COLUMNS)})"
#: The same, for a statement that writes scheduled rows (their ``due_at`` too).
_SCHEDULED_HEAD = f"INSERT INTO {MESSAGE_TABLE} ({', '.join(INSERT_COLUMNS)}, due_at)"


#: Rows per INSERT at most: 15 parameters each stay far below every driver's limit.
_ROWS_PER_INSERT = 1000


#: The text columns a caller's values reach unescaped, and their widths (None: any).
_TEXT_LIMITS: dict[str, int | None] = {**COLUMN_LIMITS, "arguments_preview": None}


def check_fits(envelope: Envelope) -> None:
    """Refuse, at the call, a value its column would truncate or reject at the INSERT."""
    _check_columns(envelope, _TEXT_LIMITS)


def _check_columns(envelope: Envelope, limits: Mapping[str, int | None]) -> None:
    where = f"Cannot enqueue task {envelope.task_name[:80]!r}"
    for column, limit in limits.items():
        value = getattr(envelope, column)
        if value is not None:
            check_text(value, column, where, limit=limit)


def left(envelope: Envelope, now: float) -> float:
    """Seconds still to a scheduled envelope's ETA at ``now`` (``time.monotonic()``).

    Its ``due_in`` was measured at the call; a row written later (a group's members
    together, a buffered row with the ``COMMIT``) is due that much sooner.
    """
    due_in = envelope.due_in or 0.0
    measured_at = envelope.due_in_measured_at
    if measured_at is None:
        return due_in
    return due_in - max(0.0, now - measured_at)


def message_values(envelope: Envelope) -> list[Any]:
    """The values of one message row, in the order of ``MESSAGE_COLUMNS``."""
    return [
        envelope.task_id,
        envelope.task_name,
        envelope.queue,
        envelope.exchange,
        envelope.routing_key,
        envelope.ordering_key,
        PAYLOAD_VERSION,
        envelope.body,
        envelope.content_type,
        envelope.content_encoding,
        json_text(envelope.headers),
        json_text(envelope.properties),
        _declare_text(envelope),
        envelope.arguments_preview,
        dump_log_context(envelope.log_context),
    ]


def _declare_text(envelope: Envelope) -> str:
    """The ``declare_queues`` column: each queue's declaration, or its bare name."""
    specs = envelope.declare_specs
    if not specs:
        return dump_json(list(envelope.declare))
    items = [
        spec or dump_json(name)
        for name, spec in zip(envelope.declare, specs, strict=True)
    ]
    return "[" + ", ".join(items) + "]"


#: Decoded ``declare_queues`` texts: nearly every row of a batch holds the same one.
_DECLARED: BoundedCache[str, tuple[tuple[str, ...], tuple[str, ...]]] = bounded_cache(
    "store.declare_queues", 256
)


def read_declarations(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The queue names and their declarations (JSON, "" for a bare name), remembered.

    Raises :class:`ValueError` when the text is not a JSON list of queue names or
    declarations.
    """
    found = _DECLARED.get(text)
    if found is None:
        try:
            items = load_json(text)
        except ValueError:
            items = None
        if type(items) is not list or not all(
            type(item) is str or is_spec(item) for item in items
        ):
            raise ValueError(
                f"its declare_queues is not a JSON list of queue names or "
                f"declarations: {text[:80]!r}"
            )
        names = tuple(item if type(item) is str else item["name"] for item in items)
        specs = tuple("" if type(item) is str else dump_json(item) for item in items)
        found = _DECLARED.put(text, (names, specs if any(specs) else ()))
    return found


def _stored_message(row: Sequence[Any]) -> StoredMessage:
    """A claimed row (CLAIM_COLUMNS, then its age) as a message; runs for every row.

    Unpacked by position (the hot path); tests/unit/test_store_rows.py holds it to
    CLAIM_COLUMNS.
    """
    (
        row_id,
        attempts,
        task_id,
        task_name,
        queue,
        exchange,
        routing_key,
        ordering_key,
        payload_version,
        body,
        content_type,
        content_encoding,
        headers,
        properties,
        declare_queues,
        arguments_preview,
        log_context,
        state,
        age,
    ) = row
    check_payload_version(int(payload_version), int(row_id))
    declared_names, declared_specs = read_declarations(declare_queues)
    envelope = Envelope(
        task_id=task_id,
        task_name=task_name,
        exchange=exchange,
        routing_key=routing_key,
        body=bytes(body),
        content_type=content_type,
        content_encoding=content_encoding,
        headers=JsonObject.read(headers, "headers"),
        properties=JsonObject.read(properties, "properties"),
        declare=declared_names,
        declare_specs=declared_specs,
        queue=queue,
        arguments_preview=arguments_preview,
        ordering_key=ordering_key,
        log_context=load_log_context(log_context),
    )
    return StoredMessage(
        int(row_id),
        int(attempts),
        envelope,
        age_seconds=None if age is None else max(0.0, float(age)),
        republish=state == RUNNING,
    )
