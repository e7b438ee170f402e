"""The SQL of ordered keys (:mod:`celery_outbox.ordering`).

The claim's head rule itself is in :meth:`.dialects.Dialect._due_where`; here are
what a claim does next in the same transaction (take a run of a key's rows, drop
coalesced rows), the settlement of held and blocked heads, the worker's reports,
the operator's actions on a blocked head, and the statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from ..envelope import load_json
from ..ordering_options import HEADER, ROW_FLAG, UNORDERED, Ordering, Policy
from ..outcomes import Decision
from ..text import storable
from .base import StoreBase
from .dialects import (
    CLAIM_COLUMNS,
    DEAD_TABLE,
    MESSAGE_COLUMNS,
    MESSAGE_TABLE,
    Dialect,
    placeholders,
)

logger = logging.getLogger("celery_outbox.store")


@dataclass(frozen=True)
class Follower:
    """A row of a key after the claimed head, in id order, as the claim sees it."""

    #: Due and in no ordering state (not running, not blocked).
    ready: bool
    strict: bool


def run_length(followers: Iterable[Follower], room: int) -> int:
    """How many of a head's followers (id order) the same claim may take, at most ``room``.

    The run stops before the first row that is not ready, and after a strict row: the
    row after a strict one waits until that one has run.
    """
    taken = 0
    for follower in followers:
        if taken >= room or not follower.ready:
            break
        taken += 1
        if follower.strict:
            break
    return taken


def superseded(
    claimed: Iterable[tuple[int, str, str]], newest: Mapping[tuple[str, str], int]
) -> frozenset[int]:
    """The claimed rows (id, key, task name) that a newer row of their group replaces."""
    return frozenset(
        row_id for row_id, key, task in claimed if newest.get((key, task), 0) > row_id
    )


RUNNING = "running"
BLOCKED = "blocked"
#: A blocked head is due again in a century: out of every claim, until an operator acts.
BLOCKED_SECONDS = 100 * 365 * 86400.0
#: Keys whose run a claim extends at most (one statement each).
RUN_KEYS = 16

_ID = CLAIM_COLUMNS.index("id")
_KEY = CLAIM_COLUMNS.index("ordering_key")
_TASK_ID = CLAIM_COLUMNS.index("task_id")
_TASK = CLAIM_COLUMNS.index("task_name")
_HEADERS = CLAIM_COLUMNS.index("headers")


@dataclass(frozen=True)
class CoalescedRow:
    """An unpublished row deleted at claim time because a newer one of its group waits."""

    task_id: str
    task_name: str
    ordering_key: str


@dataclass(frozen=True)
class KeyDepth:
    """One ordering key and how many rows wait in it."""

    key: str
    rows: int


@dataclass(frozen=True)
class BlockedHead:
    """The head of a blocked key, with the error that blocked it."""

    key: str
    id: int
    task_id: str
    task_name: str
    last_error: str
    rows: int
    #: Seconds since the head blocked its key (database clock); a reading, so two
    #: reports of one head compare equal whatever their times.
    blocked_seconds: float | None = field(default=None, compare=False)


def blocked_since(available_at: datetime) -> datetime:
    """When a blocked head blocked its key: blocking set it due :data:`BLOCKED_SECONDS` later."""
    return available_at - timedelta(seconds=BLOCKED_SECONDS)


@dataclass(frozen=True)
class OrderingStats:
    """Keyed rows at a glance: keys waiting, blocked, running, the deepest keys."""

    keys: int
    keyed_rows: int
    running: int
    blocked: tuple[BlockedHead, ...]
    deepest: tuple[KeyDepth, ...]
    oldest_head_seconds: float | None

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of ``outbox ordering stats``."""
        return {
            "keys": self.keys,
            "keyed_rows": self.keyed_rows,
            "running": self.running,
            "blocked": [vars(b) for b in self.blocked],
            "deepest": [vars(d) for d in self.deepest],
            "oldest_head_seconds": self.oldest_head_seconds,
        }


def _reported_row(task_id: str, row_token: str | None) -> tuple[str, list[Any]]:
    """The WHERE clause (and parameters) of the strict row a worker reports on.

    The task id finds the row through its index; the token, where the message
    carries one, tells it from another row of the same task id.
    """
    where = (
        f"task_id = %s AND ordering_key IS NOT NULL AND (state IS NULL OR "
        f"state = '{RUNNING}')"
    )
    if row_token is None:
        return where, [task_id]
    return f"{where} AND headers LIKE %s", [task_id, f"%{ROW_FLAG}{row_token}%"]


def row_ordering(row: Sequence[Any]) -> Ordering:
    """The ordering of a raw claimed row, decoding its headers only when they carry it."""
    key = row[_KEY]
    if key is None:
        return UNORDERED
    text = row[_HEADERS]
    if HEADER not in text:
        return Ordering(key)
    try:
        headers = load_json(text)
    except ValueError:
        return Ordering(key)  # the claim dead-letters the unreadable row
    return Ordering.read(key, headers if isinstance(headers, dict) else {})


class KeyedClaims(StoreBase):
    """What the relay's claim and settlement do to keyed rows, in their transaction."""

    # -- claim (inside the claim's transaction) ------------------------------------

    def extend_claim(
        self,
        cursor: Any,
        rows: list[Sequence[Any]],
        limit: int,
        lease_seconds: float,
        token: str,
    ) -> tuple[list[Sequence[Any]], tuple[CoalescedRow, ...]]:
        """Runs taken after claimed heads, then coalescing; the rows and what it dropped."""
        if not any(row[_KEY] is not None for row in rows):
            return rows, ()
        orderings = {int(row[_ID]): row_ordering(row) for row in rows}
        rows = rows + self._runs(cursor, rows, orderings, limit, lease_seconds, token)
        for row in rows[len(orderings) :]:
            orderings[int(row[_ID])] = row_ordering(row)
        return self._coalesce(cursor, rows, orderings, token)

    def _runs(
        self,
        cursor: Any,
        rows: Sequence[Sequence[Any]],
        orderings: dict[int, Ordering],
        limit: int,
        lease_seconds: float,
        token: str,
    ) -> list[Sequence[Any]]:
        """Rows after each claimed head of a non-strict key, while the batch has room.

        Holding the head (leased in this transaction) keeps every other claim off
        the key, so its next rows can go in the same batch, in id order.
        """
        room = limit - len(rows)
        heads = [
            (int(row[_ID]), row[_KEY])
            for row in rows
            if row[_KEY] is not None and not orderings[int(row[_ID])].strict
        ]
        dialect = self.dialect
        lock = self._for_update()
        taken: list[Sequence[Any]] = []
        for head_id, key in heads[:RUN_KEYS]:
            if room <= 0:
                break
            cursor.execute(
                f"SELECT {dialect.claim_columns()}, CASE WHEN available_at <= "
                f"{dialect.now()} AND state IS NULL THEN 1 ELSE 0 END "
                f"FROM {MESSAGE_TABLE} WHERE ordering_key = %s AND id > %s "
                f"ORDER BY id LIMIT %s{lock}",
                [key, head_id, room],
            )
            found = list(cursor.fetchall())
            count = run_length(
                (Follower(bool(int(r[-1])), row_ordering(r).strict) for r in found),
                room,
            )
            taken.extend(r[:-1] for r in found[:count])
            room -= count
        if taken:
            after_sql, after_params = dialect.after(lease_seconds)
            ids = [int(r[_ID]) for r in taken]
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET lease_token = %s, holder = %s, "
                f"available_at = {after_sql} WHERE id IN ({placeholders(ids)})",
                [token, self.holder, *after_params, *ids],
            )
        return taken

    def _coalesce(
        self,
        cursor: Any,
        rows: list[Sequence[Any]],
        orderings: dict[int, Ordering],
        token: str,
    ) -> tuple[list[Sequence[Any]], tuple[CoalescedRow, ...]]:
        """Delete the coalescing rows a newer row of their (key, task name) replaces."""
        claimed = [
            (int(r[_ID]), str(r[_KEY]), str(r[_TASK]))
            for r in rows
            if orderings[int(r[_ID])].coalesce
        ]
        if not claimed:
            return rows, ()
        keys = sorted({key for _, key, _ in claimed})
        cursor.execute(
            f"SELECT ordering_key, task_name, MAX(id) FROM {MESSAGE_TABLE} "
            f"WHERE ordering_key IN ({placeholders(keys)}) "
            f"GROUP BY ordering_key, task_name",
            keys,
        )
        newest = {(k, t): int(top) for k, t, top in cursor.fetchall()}
        replaced = superseded(claimed, newest)
        if not replaced:
            return rows, ()
        dropped: list[CoalescedRow] = []
        deleted: set[int] = set()
        groups = {(key, task) for row_id, key, task in claimed if row_id in replaced}
        for key, task in sorted(groups):
            cursor.execute(
                f"SELECT id, task_id FROM {MESSAGE_TABLE} WHERE ordering_key = %s "
                f"AND task_name = %s AND id < %s AND state IS NULL AND (lease_token "
                f"IS NULL OR lease_token = %s OR available_at <= {self.dialect.now()}) "
                f"ORDER BY id",
                [key, task, newest[(key, task)], token],
            )
            found = [(int(i), str(t)) for i, t in cursor.fetchall()]
            if not found:
                continue
            ids = [i for i, _ in found]
            cursor.execute(
                f"DELETE FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(ids)})", ids
            )
            deleted.update(ids)
            dropped.extend(CoalescedRow(t, task, key) for _, t in found)
        kept = [r for r in rows if int(r[_ID]) not in deleted]
        return kept, tuple(dropped)

    # -- settlement (inside the settlement's transaction) ---------------------------

    def _hold_running(
        self, cursor: Any, dialect: Dialect, token: str, decisions: Sequence[Decision]
    ) -> int:
        """Published strict heads stay, running, for their decision's delay."""
        if not decisions:
            return 0
        ids = [d.message_id for d in decisions]
        # One running lease for the batch: every decision carries the same delay.
        after_sql, after_params = dialect.after(max(d.delay for d in decisions))
        cursor.execute(
            f"UPDATE {MESSAGE_TABLE} SET state = '{RUNNING}', available_at = "
            f"{after_sql}, holder = NULL WHERE lease_token = %s "
            f"AND id IN ({placeholders(ids)})",
            [*after_params, token, *ids],
        )
        return int(cursor.rowcount)

    def _block_heads(
        self, cursor: Any, dialect: Dialect, token: str, decisions: Sequence[Decision]
    ) -> int:
        """Failed heads of ``block`` keys: out of every claim, with their error."""
        changed = 0
        for decision in decisions:
            after_sql, after_params = dialect.after(BLOCKED_SECONDS)
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET state = '{BLOCKED}', attempts = attempts "
                f"+ 1, last_error = %s, available_at = {after_sql}, lease_token = NULL, "
                f"holder = NULL WHERE lease_token = %s AND id = %s",
                [storable(decision.error), *after_params, token, decision.message_id],
            )
            changed += int(cursor.rowcount)
        return changed


class OrderingQueries(StoreBase):
    """Ordered keys' heads: the worker's reports for strict tasks, the operator's
    actions on a blocked head, the statistics."""

    # -- the worker's reports for strict tasks ---------------------------------------
    #
    # Each report is one statement in autocommit, except a failure's (a transaction):
    # a worker may send them on a connection of its own, outside Django's handler
    # (celery_outbox.ordering.worker). A report names its row by task id and, for
    # rows written since strict rows carry one, by the row's token: two rows may
    # share a task id (a caller's), never a token.

    def task_done(self, task_id: str, row_token: str | None = None) -> int:
        """A strict task finished: its row goes and the relay is woken for the next.

        State NULL too: the worker may finish before the relay has settled.
        """
        where, params = _reported_row(task_id, row_token)
        with self._translated(), self.connection.cursor() as cursor:
            return self.dialect.delete_waking(cursor, where, params)

    def task_failed(
        self, task_id: str, error: str, policy: Policy, row_token: str | None = None
    ) -> int:
        """A strict task failed for good: block its key, or dead-letter it and go on.

        ``error`` is made storable first (:func:`~celery_outbox.text.storable`): a
        failure that could not be recorded would keep its key waiting for ever.
        """
        dialect = self.dialect
        error = storable(error)
        where, params = _reported_row(task_id, row_token)
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            cursor.execute(
                f"SELECT id FROM {MESSAGE_TABLE} WHERE {where} ORDER BY id"
                f"{self._for_update()}",
                params,
            )
            ids = [int(row[0]) for row in cursor.fetchall()]
            if not ids:
                return 0
            if policy is Policy.SKIP:
                self._move_to_dead(cursor, dialect, ids, error)
                self._wake_relays(cursor, len(ids))
                return len(ids)
            after_sql, after_params = dialect.after(BLOCKED_SECONDS)
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET state = '{BLOCKED}', attempts = attempts "
                f"+ 1, last_error = %s, available_at = {after_sql}, lease_token = NULL, "
                f"holder = NULL WHERE id IN ({placeholders(ids)})",
                [error, *after_params, *ids],
            )
            return int(cursor.rowcount)

    def task_retrying(
        self, task_id: str, seconds: float, row_token: str | None = None
    ) -> int:
        """A strict task will run again (``retry``): its key stays held that long."""
        where, params = _reported_row(task_id, row_token)
        after_sql, after_params = self.dialect.after(seconds)
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET available_at = {after_sql} WHERE {where}",
                [*after_params, *params],
            )
            return int(cursor.rowcount)

    def task_again(self, task_id: str, row_token: str | None = None) -> int:
        """A strict task's run was lost (its worker process died): due again now.

        It stays running (so its next publish is known as a publish again), and on
        PostgreSQL listening relays are woken.
        """
        where, params = _reported_row(task_id, row_token)
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET available_at = {self.dialect.now()} "
                f"WHERE {where}",
                params,
            )
            changed = int(cursor.rowcount)
            self._wake_relays(cursor, changed)
            return changed

    # -- operators -----------------------------------------------------------------

    def blocked_heads(self) -> tuple[BlockedHead, ...]:
        """Every blocked key's head, oldest first, with how many rows its key holds."""
        # Blocking made the head due BLOCKED_SECONDS later: its age is the block's.
        age = self.dialect.age_seconds("h.available_at")
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT h.ordering_key, h.id, h.task_id, h.task_name, h.last_error, "
                f"(SELECT COUNT(*) FROM {MESSAGE_TABLE} o WHERE o.ordering_key = "
                f"h.ordering_key), {age} FROM {MESSAGE_TABLE} h WHERE h.state = "
                f"'{BLOCKED}' ORDER BY h.id",
                [],
            )
            return tuple(
                BlockedHead(
                    str(k),
                    int(i),
                    str(t),
                    str(n),
                    str(e),
                    int(c),
                    None if a is None else max(0.0, float(a) + BLOCKED_SECONDS),
                )
                for k, i, t, n, e, c, a in cursor.fetchall()
            )

    def retry_head(self, key: str) -> int:
        """Make a blocked key's head due now, with fresh attempts."""
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET state = NULL, attempts = 0, available_at "
                f"= {self.dialect.now()} WHERE ordering_key = %s AND state = "
                f"'{BLOCKED}'",
                [key],
            )
            return int(cursor.rowcount)

    def dead_letter_head(self, key: str) -> int:
        """Move a blocked key's head to the dead letters (``skip_head``): the key goes on."""
        return self.skip_head(key, dead_letter=True)

    def skip_head(self, key: str, *, dead_letter: bool = True) -> int:
        """Take a blocked key's head out (to the dead letters, or deleted): the key goes on."""
        dialect = self.dialect
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            cursor.execute(
                f"SELECT id, last_error FROM {MESSAGE_TABLE} WHERE ordering_key = %s "
                f"AND state = '{BLOCKED}' ORDER BY id{self._for_update()}",
                [key],
            )
            found = cursor.fetchall()
            if not found:
                return 0
            ids = [int(row[0]) for row in found]
            if dead_letter:
                self._move_to_dead(cursor, dialect, ids, str(found[0][1]), bump=False)
            else:
                cursor.execute(
                    f"DELETE FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(ids)})",
                    ids,
                )
            self._wake_relays(cursor, len(ids))
            return len(ids)

    def ordering_stats(self, top: int = 10) -> OrderingStats:
        """Keys waiting, rows in them, running and blocked heads, the deepest keys."""
        dialect = self.dialect
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT COUNT(DISTINCT ordering_key), COUNT(*), "
                f"SUM(CASE WHEN state = '{RUNNING}' THEN 1 ELSE 0 END) "
                f"FROM {MESSAGE_TABLE} WHERE ordering_key IS NOT NULL",
                [],
            )
            keys, rows, running = cursor.fetchone()
            cursor.execute(
                f"SELECT ordering_key, COUNT(*) FROM {MESSAGE_TABLE} WHERE ordering_key "
                f"IS NOT NULL GROUP BY ordering_key ORDER BY COUNT(*) DESC, "
                f"ordering_key LIMIT %s",
                [top],
            )
            deepest = tuple(KeyDepth(str(k), int(c)) for k, c in cursor.fetchall())
            # The oldest head is the oldest keyed row: a key's head is its oldest row.
            cursor.execute(
                f"SELECT MAX({dialect.age_seconds('created_at')}) FROM {MESSAGE_TABLE} "
                f"WHERE ordering_key IS NOT NULL",
                [],
            )
            (oldest,) = cursor.fetchone()
        return OrderingStats(
            keys=int(keys or 0),
            keyed_rows=int(rows or 0),
            running=int(running or 0),
            blocked=self.blocked_heads(),
            deepest=deepest,
            oldest_head_seconds=None if oldest is None else max(0.0, float(oldest)),
        )

    # -- helpers ---------------------------------------------------------------------

    def _move_to_dead(
        self,
        cursor: Any,
        dialect: Dialect,
        ids: Sequence[int],
        error: str,
        *,
        bump: bool = True,
    ) -> None:
        columns = ", ".join(MESSAGE_COLUMNS)
        attempts = "attempts + 1" if bump else "attempts"
        cursor.execute(
            f"INSERT INTO {DEAD_TABLE} (original_id, {columns}, attempts, last_error, "
            f"created_at, dead_at) SELECT id, {columns}, {attempts}, %s, created_at, "
            f"{dialect.now()} FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(ids)}) "
            f"ORDER BY id",
            [storable(error), *ids],
        )
        cursor.execute(
            f"DELETE FROM {MESSAGE_TABLE} WHERE id IN ({placeholders(ids)})", list(ids)
        )
