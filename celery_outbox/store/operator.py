"""Operator queries: summaries, retry now, dead letters (move, replay, purge, delete).

Used by the admin, the ``outbox`` commands and the retention task; part of the store,
so all outbox SQL stays in this package.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from django.conf import settings
from django.db import models, transaction

from ..envelope import Envelope, load_json
from ..states import BLOCKED, DEAD, PARKED, REVOKED
from ..text import storable
from .dialects import (
    DEAD_TABLE,
    INSERT_COLUMNS,
    MESSAGE_COLUMNS,
    MESSAGE_TABLE,
    WAITING_SINCE,
    placeholders,
)
from .flows import parked_by_flow
from .history import HistoryWriter
from .types import (
    BacklogGroup,
    DeadLetterFilter,
    DeadTask,
    Progress,
    PurgeReport,
    ReplayReport,
    RetryingTask,
    Stats,
    Summary,
    TopFailures,
)

logger = logging.getLogger("celery_outbox.store")

#: Ids per statement in the operator methods.
OPERATOR_CHUNK = 500


class OperatorQueries(HistoryWriter):
    """What operators do to the outbox and the dead letters."""

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
        """Counts of pending, due, in-flight, scheduled, blocked and dead rows; the
        oldest waiting row's age and when the next scheduled row falls due.

        A scheduled row is not late while it waits: it is left out of the oldest
        age until its ETA, and counted from its ETA after that.
        """
        dialect = self.dialect
        now = dialect.now()
        scheduled = _scheduled(now)
        waiting = f"CASE WHEN NOT ({scheduled}) THEN {WAITING_SINCE} END"
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COUNT(*), "
                f"COALESCE(SUM(CASE WHEN available_at <= {now} THEN 1 ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN lease_token IS NOT NULL AND available_at > {now} "
                f"THEN 1 ELSE 0 END), 0), "
                f"COALESCE(SUM(CASE WHEN {scheduled} THEN 1 ELSE 0 END), 0), "
                f"{dialect.age_seconds(f'MIN({waiting})')}, "
                f"{dialect.age_seconds(f'MIN(CASE WHEN {scheduled} THEN due_at END)')}, "
                f"COALESCE(SUM(CASE WHEN state = '{BLOCKED}' THEN 1 ELSE 0 END), 0) "
                f"FROM {MESSAGE_TABLE}",
                [],
            )
            (pending, due, in_flight, waiting_eta, oldest, next_due, blocked) = (
                cursor.fetchone()
            )
            cursor.execute(f"SELECT COUNT(*) FROM {DEAD_TABLE}", [])
            (dead,) = cursor.fetchone()
        return Stats(
            int(pending),
            int(due),
            int(in_flight),
            int(dead),
            None if oldest is None else max(0.0, float(oldest)),
            scheduled=int(waiting_eta),
            next_due_seconds=None if next_due is None else max(0.0, -float(next_due)),
            blocked=int(blocked),
        )

    def summary(self, groups: int = 20) -> Summary:
        """Totals, the oldest age and the ``groups`` largest backlogs by task name and queue."""
        dialect = self.dialect
        now = dialect.now()
        stats = self.stats()
        waiting = f"CASE WHEN NOT ({_scheduled(now)}) THEN {WAITING_SINCE} END"
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COALESCE(SUM(CASE WHEN attempts > 0 AND lease_token IS NULL "
                f"AND available_at > {now} THEN 1 ELSE 0 END), 0) FROM {MESSAGE_TABLE}",
                [],
            )
            (retrying,) = cursor.fetchone()
            cursor.execute(
                f"SELECT task_name, queue, COUNT(*), "
                f"COALESCE(SUM(CASE WHEN available_at <= {now} THEN 1 ELSE 0 END), 0), "
                f"{dialect.age_seconds(f'MIN({waiting})')} FROM {MESSAGE_TABLE} "
                f"GROUP BY task_name, queue ORDER BY COUNT(*) DESC, task_name, queue "
                f"LIMIT %s",
                [groups],
            )
            rows = cursor.fetchall()
            cursor.execute(
                f"SELECT flow_key, last_error, COUNT(*) FROM {MESSAGE_TABLE} WHERE "
                f"state = '{PARKED}' GROUP BY flow_key, last_error",
                [],
            )
            parked: dict[str, int] = {}
            for name, _, count in parked_by_flow(
                (str(k), str(e or ""), int(n)) for k, e, n in cursor.fetchall()
            ):
                parked[name] = parked.get(name, 0) + count
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
            retrying=int(retrying),
            in_flight=stats.in_flight,
            dead=stats.dead,
            oldest_pending_seconds=stats.oldest_pending_seconds,
            backlog=backlog,
            scheduled=stats.scheduled,
            next_due_seconds=stats.next_due_seconds,
            parked=tuple(sorted(parked.items())),
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
        for cursor, free in self._unleased_chunks(ids):
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
        for cursor, free in self._unleased_chunks(ids):
            self.record_outbox(cursor, DEAD, free, errors=reason)
            cursor.execute(
                f"INSERT INTO {DEAD_TABLE} (original_id, {columns}, attempts, "
                f"last_error, created_at, dead_at) SELECT id, {columns}, attempts, %s, "
                f"created_at, {now} FROM {MESSAGE_TABLE} "
                f"WHERE id IN ({placeholders(free)}) ORDER BY id",
                [storable(reason), *free],
            )
            cursor.execute(
                f"DELETE FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(free)})",
                free,
            )
            moved.extend(free)
        return moved

    def revoke(
        self, task_ids: Sequence[str], *, skip_locked: bool = False
    ) -> list[Envelope]:
        """Delete the outbox rows of these tasks, in the caller's transaction.

        Rows a relay holds right now are left to it: the relay is publishing them,
        and the revoke broadcast stops them at the workers. With ``skip_locked``,
        rows another transaction has locked (a caller revoking them, a relay
        claiming them) are left to it as well, without waiting for it. With history
        on, each deleted row leaves a ``revoked`` event. Returns the messages
        deleted, as they would have been published (the result backend needs what
        the worker would have read).
        """
        wanted = list(dict.fromkeys(str(task_id) for task_id in task_ids))
        if not wanted:
            return []
        lock = self._for_update()
        features = self.connection.features
        if lock and skip_locked and features.has_select_for_update_skip_locked:
            lock = " " + str(self.connection.ops.for_update_sql(skip_locked=True))
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            # The lease is judged on the statement's clock: a revoke may come late
            # in a long transaction (PostgreSQL's now() is its start).
            cursor.execute(
                f"SELECT id, {', '.join(_REVOKED_COLUMNS)} FROM {MESSAGE_TABLE} "
                f"WHERE task_id IN ({placeholders(wanted)}) "
                f"AND (lease_token IS NULL OR available_at <= {self.dialect.clock()}) "
                f"ORDER BY id{lock}",
                wanted,
            )
            # Exactly these ids: MySQL's collation would match another case too.
            exact = set(wanted)
            found = [row for row in cursor.fetchall() if str(row[1]) in exact]
            ids = [int(row[0]) for row in found]
            if ids:
                self.record_outbox(cursor, REVOKED, ids)
                cursor.execute(
                    f"DELETE FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(ids)})",
                    ids,
                )
        return [_revoked_message(row[1:]) for row in found]

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
            # Only what matches now: letters that die while the replay runs (the
            # relay refusing the replayed rows again, say) are not chased.
            top = matching.aggregate(top=models.Max("id"))["top"]
            if top is not None:
                matching = matching.filter(id__lte=top)
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
                    f"WHERE id IN ({placeholders(ids)}) ORDER BY id{self._for_update()}",
                    ids,
                )
                locked = cursor.fetchall()
                held = [int(row[0]) for row in locked]
                if held:
                    cursor.execute(
                        f"INSERT INTO {MESSAGE_TABLE} ({', '.join(INSERT_COLUMNS)}) "
                        f"SELECT {columns}, 0, '', {now}, {now} FROM {DEAD_TABLE} "
                        f"WHERE id IN ({placeholders(held)}) ORDER BY id",
                        held,
                    )
                    self.record_replayed(cursor, held)
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
            where += f" AND {dialect.exact('task_name')} IN ({placeholders(names)})"
            params.extend(names)
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT COUNT(*) FROM {DEAD_TABLE} WHERE {where}", params)
            (matched,) = cursor.fetchone()
        if dry_run or not matched:
            return PurgeReport(int(matched), 0, dry_run)
        deleted = self._delete_in_chunks(
            f"SELECT id FROM {DEAD_TABLE} WHERE {where} ORDER BY id LIMIT %s",
            params,
            lambda ids: (
                f"DELETE FROM {DEAD_TABLE} WHERE id IN ({placeholders(ids)})",
                ids,
            ),
            chunk_size,
        )
        return PurgeReport(int(matched), deleted, False)

    def delete_dead_letters(self, ids: Sequence[int]) -> list[int]:
        """Delete the given dead letters; returns the ids that existed and were deleted."""
        deleted: list[int] = []
        for chunk in id_chunks(ids):
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                cursor.execute(
                    f"SELECT id FROM {DEAD_TABLE} WHERE id IN ({placeholders(chunk)}) "
                    f"ORDER BY id{self._for_update()}",
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

    def _unleased_chunks(self, ids: Sequence[int]) -> Iterator[tuple[Any, list[int]]]:
        """Per chunk of ``ids``, one transaction with the rows no relay holds locked.

        Yields ``(cursor, ids)``; the caller's statements run inside that transaction,
        and an exception in them rolls it back.
        """
        for chunk in id_chunks(ids):
            with (
                self._translated(),
                transaction.atomic(using=self.alias),
                self.connection.cursor() as cursor,
            ):
                free = self._lock_unleased(cursor, chunk)
                if free:
                    yield cursor, free

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
            # Every spelling as stored: MySQL's collation would fold "shop.Export"
            # and "shop.export" into one, and the glob is case-sensitive.
            cursor.execute(
                f"SELECT DISTINCT {self.dialect.exact('task_name')} FROM {DEAD_TABLE}",
                [],
            )
            names = [_text(row[0]) for row in cursor.fetchall()]
        return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))

    def _dead_letters(self, selection: DeadLetterFilter) -> Any:
        """A queryset of the dead letters a filter matches, on this alias."""
        from ..models import DeadLetter

        matching = DeadLetter.objects.using(self.alias).all()
        if selection.ids is not None:  # () matches nothing, never everything
            matching = matching.filter(id__in=list(selection.ids))
        if selection.task is not None:
            names = self._dead_task_names(selection.task)
            if not names:
                matching = matching.none()
            else:  # compared as purge does: exactly, whatever the collation
                matching = matching.extra(
                    where=[
                        f"{self.dialect.exact('task_name')} IN ({placeholders(names)})"
                    ],
                    params=names,
                )
        if selection.since is not None:
            matching = matching.filter(dead_at__gte=self._as_stored(selection.since))
        if selection.until is not None:
            matching = matching.filter(dead_at__lt=self._as_stored(selection.until))
        return matching

    def _as_stored(self, moment: datetime) -> datetime:
        """``moment`` as the ORM compares it with ``dead_at`` on this connection.

        Without ``USE_TZ`` MySQL and SQLite take naive datetimes only; the outbox
        writes ``dead_at`` in UTC there, so a moment becomes naive UTC.
        """
        if (
            settings.USE_TZ
            or self.connection.features.supports_timezones
            or moment.tzinfo is None
        ):
            return moment
        return moment.astimezone(timezone.utc).replace(tzinfo=None)


def _scheduled(now: str) -> str:
    """SQL: the row waits for its ETA (scheduled), by the database clock ``now``."""
    return f"due_at > {now} AND lease_token IS NULL AND available_at > {now}"


def _text(value: Any) -> str:
    """A text column's value; a binary comparison hands it back as bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")
    return str(value)


def id_chunks(ids: Sequence[int], size: int = OPERATOR_CHUNK) -> Iterator[list[int]]:
    """``ids`` without repeats, in their order, ``size`` at a time (one statement each)."""
    unique = list(dict.fromkeys(int(i) for i in ids))
    for start in range(0, len(unique), size):
        yield unique[start : start + size]


#: What :meth:`OperatorQueries.revoke` reads of each row it deletes.
_REVOKED_COLUMNS = (
    "task_id",
    "task_name",
    "exchange",
    "routing_key",
    "body",
    "content_type",
    "content_encoding",
    "headers",
    "properties",
)


def _revoked_message(row: Sequence[Any]) -> Envelope:
    """A deleted row (:data:`_REVOKED_COLUMNS`) as the message it held."""
    task_id, task_name, exchange, routing_key, body, ctype, cencoding, h, p = row
    return Envelope(
        task_id=str(task_id),
        task_name=str(task_name),
        exchange=str(exchange),
        routing_key=str(routing_key),
        body=bytes(body),
        content_type=str(ctype),
        content_encoding=str(cencoding),
        headers=_json_object(h),
        properties=_json_object(p),
    )


def _json_object(text: Any) -> dict[str, Any]:
    """A stored JSON object, or ``{}`` when the text is not one."""
    try:
        value = load_json(str(text))
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
