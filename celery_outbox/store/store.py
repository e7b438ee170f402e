"""OutboxStore: every read and write of the outbox tables goes through here."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, InterfaceError, connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from ..envelope import (
    PAYLOAD_VERSION,
    Envelope,
    StoredMessage,
    check_payload_version,
    dump_json,
    dump_log_context,
    load_json,
    load_log_context,
)
from ..exceptions import (
    OutboxConfigurationError,
    OutboxDatabaseError,
    UnsupportedPayloadVersion,
)
from ..relay.core import Action, Decision, Settlement
from .dialects import (
    DEAD_TABLE,
    MESSAGE_COLUMNS,
    MESSAGE_TABLE,
    Dialect,
    dialect_for,
    placeholders,
)

logger = logging.getLogger("celery_outbox.store")

_INSERT_COLUMNS = (
    *MESSAGE_COLUMNS,
    "attempts",
    "last_error",
    "created_at",
    "available_at",
)


@dataclass(frozen=True)
class Claim:
    """Rows leased to one relay under one token."""

    token: str
    messages: tuple[StoredMessage, ...]
    #: Rows this relay cannot read (a newer payload version), handed back as dead letters.
    unreadable: tuple[Decision, ...] = ()


@dataclass(frozen=True)
class SettleReport:
    """How many rows each part of a settlement changed; fewer than asked means a lost lease."""

    deleted: int = 0
    retried: int = 0
    dead_lettered: int = 0
    released: int = 0


@dataclass(frozen=True)
class Stats:
    """A snapshot of the outbox."""

    pending: int
    due: int
    in_flight: int
    dead: int
    oldest_pending_seconds: float | None

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of ``outbox stats --format json``."""
        return {
            "pending": self.pending,
            "due": self.due,
            "in_flight": self.in_flight,
            "dead": self.dead,
            "oldest_pending_seconds": self.oldest_pending_seconds,
        }


@dataclass(frozen=True)
class BacklogGroup:
    """Waiting rows of one task name on one queue."""

    task_name: str
    queue: str
    pending: int
    due: int
    oldest_seconds: float | None


@dataclass(frozen=True)
class Summary:
    """What an operator looks at first: totals, the oldest age and the biggest backlogs."""

    pending: int
    due: int
    waiting_retry: int
    in_flight: int
    dead: int
    oldest_pending_seconds: float | None
    backlog: tuple[BacklogGroup, ...] = ()


@dataclass(frozen=True)
class RetryingTask:
    """Outbox rows of one task name that the broker refused at least once."""

    task_name: str
    rows: int
    attempts: int
    max_attempts: int


@dataclass(frozen=True)
class DeadTask:
    """Dead letters of one task name."""

    task_name: str
    dead: int


@dataclass(frozen=True)
class TopFailures:
    """The task names that fail most, in the outbox and among the dead letters."""

    retrying: tuple[RetryingTask, ...]
    dead: tuple[DeadTask, ...]


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters to replay: every given condition must hold.

    ``ids`` are dead-letter ids, ``task`` a task name or glob (``shop.*``), and
    ``since``/``until`` bound ``dead_at`` (``since <= dead_at < until``).
    """

    ids: tuple[int, ...] = ()
    task: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    @property
    def is_empty(self) -> bool:
        """Whether no condition was given (the filter matches every dead letter)."""
        return (
            not self.ids
            and self.task is None
            and self.since is None
            and self.until is None
        )


@dataclass(frozen=True)
class ReplayReport:
    """What a replay did (or, with ``dry_run``, would do)."""

    matched: int
    replayed: int
    dry_run: bool
    by_task: Mapping[str, int] = field(default_factory=dict)
    #: Ids of the dead letters that were replayed (and deleted).
    ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PurgeReport:
    """How many dead letters a purge deleted (or, with ``dry_run``, would delete)."""

    matched: int
    deleted: int
    dry_run: bool


#: Called after each replayed chunk with (replayed so far, total matched).
Progress = Callable[[int, int], None]

#: Ids per statement in the operator methods.
OPERATOR_CHUNK = 500


class OutboxStore:
    """The one door to the outbox tables on one database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    @property
    def connection(self) -> BaseDatabaseWrapper:
        """The Django connection of the outbox alias."""
        return connections[self.alias]

    @property
    def dialect(self) -> Dialect:
        """SQL for this alias's vendor."""
        return dialect_for(self.connection)

    # -- enqueue ---------------------------------------------------------------

    def insert(self, envelopes: Sequence[Envelope], *, notify: bool = False) -> None:
        """Write messages in the caller's current transaction, in one statement.

        With ``notify`` on PostgreSQL the same statement tells listening relays.
        """
        if not envelopes:
            return
        dialect = self.dialect
        now = dialect.now()
        row = f"({placeholders(MESSAGE_COLUMNS)}, 0, '', {now}, {now})"
        params: list[Any] = []
        for envelope in envelopes:
            params.extend(_message_values(envelope))
        sql = dialect.insert(
            f"INSERT INTO {MESSAGE_TABLE} ({', '.join(_INSERT_COLUMNS)}) VALUES "
            + ", ".join([row] * len(envelopes)),
            notify,
        )
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)

    # -- relay -----------------------------------------------------------------

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
            rows = self.dialect.claim(cursor, limit, lease_seconds, token, task_ids)
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
        return Claim(token, tuple(messages), tuple(unreadable))

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
            deleted = self._delete(cursor, token, settlement.delete)
            retried = self._requeue(
                cursor, dialect, token, settlement.retry, count=True
            )
            released = self._requeue(
                cursor, dialect, token, settlement.release, count=False
            )
            dead = self._dead_letter(cursor, dialect, token, settlement.dead_letter)
        report = SettleReport(deleted, retried, dead, released)
        if (deleted, retried, dead, released) != (
            len(settlement.delete),
            len(settlement.retry),
            len(settlement.dead_letter),
            len(settlement.release),
        ):
            logger.warning(
                "Lease %s was lost for some rows (another relay may have claimed them): "
                "asked %s, changed %s",
                token,
                settlement,
                report,
            )
        return report

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
        """Raise :class:`OutboxDatabaseError` unless the outbox table answers."""
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {MESSAGE_TABLE} WHERE 1 = 0", [])
            cursor.fetchall()

    def reset_connection(self) -> None:
        """Drop a connection that failed, so the next statement reconnects."""
        connection = self.connection
        if connection.in_atomic_block:
            return
        with contextlib.suppress(Exception):
            connection.close()

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

    # -- operators -------------------------------------------------------------

    def explain_claim(self, limit: int = 500) -> str:
        """The database's plan for the claim query, as text (to check index use)."""
        dialect = self.dialect
        query = dialect.due_ids_sql()
        prefix = {
            "postgresql": "EXPLAIN (FORMAT JSON) ",
            "mysql": "EXPLAIN FORMAT=JSON ",
            "sqlite": "EXPLAIN QUERY PLAN ",
        }[dialect.vendor]
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(prefix + query, [limit])
            rows = cursor.fetchall()
        # psycopg hands back PostgreSQL's JSON plan already parsed: show it as JSON.
        return "\n".join(
            " ".join(c if isinstance(c, str) else json.dumps(c) for c in row)
            for row in rows
        )

    def stats(self) -> Stats:
        """Counts of pending, due, in-flight and dead rows, and the oldest row's age."""
        dialect = self.dialect
        now = dialect.now()
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COUNT(*), "
                f"COALESCE(SUM(CASE WHEN available_at <= {now} THEN 1 ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN lease_token IS NOT NULL AND available_at > {now} "
                f"THEN 1 ELSE 0 END), 0) FROM {MESSAGE_TABLE}",
                [],
            )
            pending, due, in_flight = cursor.fetchone()
            cursor.execute(f"SELECT COUNT(*) FROM {DEAD_TABLE}", [])
            (dead,) = cursor.fetchone()
            cursor.execute(
                f"SELECT {dialect.age_seconds('created_at')} FROM {MESSAGE_TABLE} "
                f"ORDER BY id LIMIT 1",
                [],
            )
            oldest = cursor.fetchone()
        age = (
            None if oldest is None or oldest[0] is None else max(0.0, float(oldest[0]))
        )
        return Stats(int(pending), int(due), int(in_flight), int(dead), age)

    def summary(self, groups: int = 20) -> Summary:
        """Totals, the oldest age and the ``groups`` largest backlogs by task name and queue."""
        dialect = self.dialect
        now = dialect.now()
        stats = self.stats()
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COALESCE(SUM(CASE WHEN attempts > 0 AND lease_token IS NULL "
                f"AND available_at > {now} THEN 1 ELSE 0 END), 0) FROM {MESSAGE_TABLE}",
                [],
            )
            (waiting,) = cursor.fetchone()
            cursor.execute(
                f"SELECT task_name, queue, COUNT(*), "
                f"COALESCE(SUM(CASE WHEN available_at <= {now} THEN 1 ELSE 0 END), 0), "
                f"{dialect.age_seconds('MIN(created_at)')} FROM {MESSAGE_TABLE} "
                f"GROUP BY task_name, queue ORDER BY COUNT(*) DESC, task_name, queue "
                f"LIMIT %s",
                [groups],
            )
            rows = cursor.fetchall()
        backlog = tuple(
            BacklogGroup(
                str(name),
                str(queue),
                int(pending),
                int(due),
                None if age is None else max(0.0, float(age)),
            )
            for name, queue, pending, due, age in rows
        )
        return Summary(
            pending=stats.pending,
            due=stats.due,
            waiting_retry=int(waiting),
            in_flight=stats.in_flight,
            dead=stats.dead,
            oldest_pending_seconds=stats.oldest_pending_seconds,
            backlog=backlog,
        )

    def top_failures(self, limit: int = 10) -> TopFailures:
        """The ``limit`` task names with most refused rows, and with most dead letters."""
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT task_name, COUNT(*), COALESCE(SUM(attempts), 0), "
                f"COALESCE(MAX(attempts), 0) FROM {MESSAGE_TABLE} "
                f"WHERE attempts > 0 OR last_error <> '' GROUP BY task_name "
                f"ORDER BY COUNT(*) DESC, task_name LIMIT %s",
                [limit],
            )
            retrying = tuple(
                RetryingTask(str(name), int(rows), int(total), int(most))
                for name, rows, total, most in cursor.fetchall()
            )
            cursor.execute(
                f"SELECT task_name, COUNT(*) FROM {DEAD_TABLE} GROUP BY task_name "
                f"ORDER BY COUNT(*) DESC, task_name LIMIT %s",
                [limit],
            )
            dead = tuple(
                DeadTask(str(name), int(count)) for name, count in cursor.fetchall()
            )
        return TopFailures(retrying, dead)

    def retry_now(self, ids: Sequence[int]) -> list[int]:
        """Make the given rows due now; rows leased to a relay are left alone.

        Returns the ids that were changed.
        """
        now = self.dialect.now()
        changed: list[int] = []
        for chunk in _chunks(ids):
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                free = self._lock_unleased(cursor, chunk)
                if free:
                    cursor.execute(
                        f"UPDATE {MESSAGE_TABLE} SET available_at = {now} "
                        f"WHERE id IN ({placeholders(free)})",
                        free,
                    )
                    changed.extend(free)
        return changed

    def move_to_dead_letters(self, ids: Sequence[int], reason: str) -> list[int]:
        """Move the given rows to the dead letters with ``reason`` as their last error.

        Rows leased to a relay are left alone. Returns the ids that were moved.
        """
        columns = ", ".join(MESSAGE_COLUMNS)
        now = self.dialect.now()
        moved: list[int] = []
        for chunk in _chunks(ids):
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                free = self._lock_unleased(cursor, chunk)
                if not free:
                    continue
                cursor.execute(
                    f"INSERT INTO {DEAD_TABLE} (original_id, {columns}, attempts, "
                    f"last_error, created_at, dead_at) SELECT id, {columns}, attempts, %s, "
                    f"created_at, {now} FROM {MESSAGE_TABLE} "
                    f"WHERE id IN ({placeholders(free)}) ORDER BY id",
                    [reason[:4000], *free],
                )
                cursor.execute(
                    f"DELETE FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(free)})",
                    free,
                )
                moved.extend(free)
        return moved

    def replay_dead_letters(
        self,
        selection: DeadLetterFilter,
        *,
        dry_run: bool = False,
        chunk_size: int = OPERATOR_CHUNK,
        progress: Progress | None = None,
    ) -> ReplayReport:
        """Put matching dead letters back into the outbox, due now, with attempts reset.

        Each becomes a new outbox row holding the same message (same task id, same
        bytes) and the dead letter is deleted, in one transaction per chunk. With
        ``dry_run`` nothing changes and the report says what would be replayed.
        """
        matching = self._dead_letters(selection)
        with self._translated():
            counts = {
                str(row["task_name"]): int(row["n"])
                for row in matching.order_by()
                .values("task_name")
                .annotate(n=models.Count("id"))
            }
        total = sum(counts.values())
        if dry_run or not total:
            return ReplayReport(total, 0, dry_run, dict(sorted(counts.items())))
        columns = ", ".join(MESSAGE_COLUMNS)
        now = self.dialect.now()
        replayed: dict[str, int] = {}
        replayed_ids: list[int] = []
        done = 0
        last = 0
        while True:
            with self._translated():
                ids = list(
                    matching.filter(id__gt=last)
                    .order_by("id")
                    .values_list("id", flat=True)[:chunk_size]
                )
            if not ids:
                break
            last = ids[-1]
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                cursor.execute(
                    f"SELECT id, task_name FROM {DEAD_TABLE} "
                    f"WHERE id IN ({placeholders(ids)}){self._for_update()}",
                    ids,
                )
                locked = cursor.fetchall()
                held = [int(row[0]) for row in locked]
                if held:
                    cursor.execute(
                        f"INSERT INTO {MESSAGE_TABLE} ({', '.join(_INSERT_COLUMNS)}) "
                        f"SELECT {columns}, 0, '', {now}, {now} FROM {DEAD_TABLE} "
                        f"WHERE id IN ({placeholders(held)}) ORDER BY id",
                        held,
                    )
                    cursor.execute(
                        f"DELETE FROM {DEAD_TABLE} WHERE id IN ({placeholders(held)})",
                        held,
                    )
            for _, name in locked:
                replayed[str(name)] = replayed.get(str(name), 0) + 1
            done += len(held)
            replayed_ids.extend(held)
            if progress is not None:
                progress(done, total)
        return ReplayReport(
            total, done, False, dict(sorted(replayed.items())), tuple(replayed_ids)
        )

    def purge_dead_letters(
        self,
        older_than: float,
        *,
        task: str | None = None,
        dry_run: bool = False,
        chunk_size: int = 1000,
    ) -> PurgeReport:
        """Delete dead letters that died more than ``older_than`` seconds ago, in chunks.

        ``task`` limits the purge to task names matching a glob. With ``dry_run`` only
        the count is returned.
        """
        dialect = self.dialect
        with self._translated(), self.connection.cursor() as cursor:
            cutoff_sql, cutoff_params = dialect.after(-older_than)
            cursor.execute(f"SELECT {cutoff_sql}", cutoff_params)
            (cutoff,) = cursor.fetchone()
        where = "dead_at < %s"
        params: list[Any] = [cutoff]
        if task is not None:
            names = self._dead_task_names(task)
            if not names:
                return PurgeReport(0, 0, dry_run)
            where += f" AND task_name IN ({placeholders(names)})"
            params.extend(names)
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT COUNT(*) FROM {DEAD_TABLE} WHERE {where}", params)
            (matched,) = cursor.fetchone()
        if dry_run or not matched:
            return PurgeReport(int(matched), 0, dry_run)
        deleted = 0
        while True:
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                cursor.execute(
                    f"SELECT id FROM {DEAD_TABLE} WHERE {where} ORDER BY id LIMIT %s",
                    [*params, chunk_size],
                )
                ids = [int(row[0]) for row in cursor.fetchall()]
                if ids:
                    cursor.execute(
                        f"DELETE FROM {DEAD_TABLE} WHERE id IN ({placeholders(ids)})",
                        ids,
                    )
                    deleted += int(cursor.rowcount)
            if len(ids) < chunk_size:
                break
        return PurgeReport(int(matched), deleted, False)

    def delete_dead_letters(self, ids: Sequence[int]) -> list[int]:
        """Delete the given dead letters; returns the ids that existed and were deleted."""
        deleted: list[int] = []
        for chunk in _chunks(ids):
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                cursor.execute(
                    f"SELECT id FROM {DEAD_TABLE} WHERE id IN ({placeholders(chunk)})"
                    f"{self._for_update()}",
                    list(chunk),
                )
                held = [int(row[0]) for row in cursor.fetchall()]
                if held:
                    cursor.execute(
                        f"DELETE FROM {DEAD_TABLE} WHERE id IN ({placeholders(held)})",
                        held,
                    )
                    deleted.extend(held)
        return deleted

    # -- internals -------------------------------------------------------------

    def _for_update(self) -> str:
        """`` FOR UPDATE`` where the vendor has row locks (SQLite has one writer)."""
        connection = self.connection
        if not connection.features.has_select_for_update:
            return ""
        return " " + str(connection.ops.for_update_sql())

    def _lock_unleased(self, cursor: Any, ids: Sequence[int]) -> list[int]:
        """Lock the rows among ``ids`` that no relay holds; returns their ids.

        A row is held while its lease token is set and its lease has not ended. With
        the row lock a relay's claim (SKIP LOCKED) passes it by until we commit.
        """
        cursor.execute(
            f"SELECT id FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(ids)}) "
            f"AND (lease_token IS NULL OR available_at <= {self.dialect.now()}) "
            f"ORDER BY id{self._for_update()}",
            list(ids),
        )
        return [int(row[0]) for row in cursor.fetchall()]

    def _dead_task_names(self, pattern: str) -> list[str]:
        """Task names among the dead letters that match a glob."""
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT DISTINCT task_name FROM {DEAD_TABLE}", [])
            names = [str(row[0]) for row in cursor.fetchall()]
        return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))

    def _dead_letters(self, selection: DeadLetterFilter) -> Any:
        """A queryset of the dead letters a filter matches, on this alias."""
        from ..models import DeadLetter

        matching = DeadLetter.objects.using(self.alias).all()
        if selection.ids:
            matching = matching.filter(id__in=list(selection.ids))
        if selection.task is not None:
            matching = matching.filter(
                task_name__in=self._dead_task_names(selection.task)
            )
        if selection.since is not None:
            matching = matching.filter(dead_at__gte=selection.since)
        if selection.until is not None:
            matching = matching.filter(dead_at__lt=selection.until)
        return matching

    def _delete(self, cursor: Any, token: str, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        cursor.execute(
            f"DELETE FROM {MESSAGE_TABLE} WHERE lease_token = %s AND id IN ({placeholders(ids)})",
            [token, *ids],
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
        changed = 0
        bump = "attempts = attempts + 1, " if count else ""
        for decision in decisions:
            after_sql, after_params = dialect.after(decision.delay)
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET {bump}last_error = %s, available_at = {after_sql}, "
                f"lease_token = NULL WHERE id = %s AND lease_token = %s",
                [decision.error[:4000], *after_params, decision.message_id, token],
            )
            changed += int(cursor.rowcount)
        return changed

    def _dead_letter(
        self, cursor: Any, dialect: Dialect, token: str, decisions: Sequence[Decision]
    ) -> int:
        columns = ", ".join(MESSAGE_COLUMNS)
        moved = 0
        for decision in decisions:
            cursor.execute(
                f"INSERT INTO {DEAD_TABLE} (original_id, {columns}, attempts, last_error, "
                f"created_at, dead_at) SELECT id, {columns}, attempts + 1, %s, created_at, "
                f"{dialect.now()} FROM {MESSAGE_TABLE} WHERE id = %s AND lease_token = %s",
                [decision.error[:4000], decision.message_id, token],
            )
            if cursor.rowcount:
                cursor.execute(
                    f"DELETE FROM {MESSAGE_TABLE} WHERE id = %s AND lease_token = %s",
                    [decision.message_id, token],
                )
                moved += int(cursor.rowcount)
        return moved

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except (DatabaseError, InterfaceError) as exc:
            raise OutboxDatabaseError(
                f"outbox database {self.alias!r}: {type(exc).__name__}: {exc}"
            ) from exc


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


def _chunks(ids: Sequence[int], size: int = OPERATOR_CHUNK) -> Iterator[list[int]]:
    unique = list(dict.fromkeys(int(i) for i in ids))
    for start in range(0, len(unique), size):
        yield unique[start : start + size]


def _message_values(envelope: Envelope) -> list[Any]:
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
        dump_json(dict(envelope.headers)),
        dump_json(dict(envelope.properties)),
        dump_json(list(envelope.declare)),
        envelope.arguments_preview,
        dump_log_context(envelope.log_context),
    ]


#: Decoded ``declare_queues`` texts: nearly every row of a batch holds the same one.
_DECLARE_CACHE: dict[str, tuple[str, ...]] = {}


def _declare_queues(text: str) -> tuple[str, ...]:
    """``tuple(load_json(text))``, remembered (the result is immutable)."""
    found = _DECLARE_CACHE.get(text)
    if found is None:
        found = tuple(load_json(text))
        if len(_DECLARE_CACHE) >= 256:
            _DECLARE_CACHE.clear()
        _DECLARE_CACHE[text] = found
    return found


def _stored_message(row: Sequence[Any]) -> StoredMessage:
    *columns, age = row
    values = dict(zip(("id", "attempts", *MESSAGE_COLUMNS), columns, strict=True))
    check_payload_version(int(values["payload_version"]), int(values["id"]))
    envelope = Envelope(
        task_id=values["task_id"],
        task_name=values["task_name"],
        exchange=values["exchange"],
        routing_key=values["routing_key"],
        body=bytes(values["body"]),
        content_type=values["content_type"],
        content_encoding=values["content_encoding"],
        headers=load_json(values["headers"]),
        properties=load_json(values["properties"]),
        declare=_declare_queues(values["declare_queues"]),
        queue=values["queue"],
        arguments_preview=values["arguments_preview"],
        ordering_key=values["ordering_key"],
        log_context=load_log_context(values["log_context"]),
    )
    return StoredMessage(
        int(values["id"]),
        int(values["attempts"]),
        envelope,
        age_seconds=None if age is None else max(0.0, float(age)),
    )
