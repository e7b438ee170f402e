"""The operator's queries in memory: a real :class:`~.protocol.OperatorStore` for tests.

It answers and acts as :class:`~celery_outbox.store.operator.OperatorQueries` does,
on the :class:`~.memory.Tables` an :class:`~.memory.InMemoryStore` relays from, so
a test can drive ``outbox tasks stats``, ``replay`` and ``purge`` (:mod:`celery_outbox.operations`)
against the rows the relay loop left, without a database. Time is the tables'
clock; ``since``/``until`` of a replay read it as seconds since the epoch.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from .memory import DeadRow, Row, Tables
from .operator import OPERATOR_CHUNK, id_chunks
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


class InMemoryOperatorQueries:
    """What operators do to the outbox and the dead letters, on in-memory tables."""

    def __init__(self, tables: Tables) -> None:
        """``tables``: those of the :class:`~.memory.InMemoryStore` under test."""
        self.tables = tables

    def stats(self) -> Stats:
        """Counts of pending, due, in-flight and dead rows, and the oldest row's age."""
        with self.tables.lock:
            now = self.tables.clock()
            rows = list(self.tables.rows.values())
            dead = len(self.tables.dead)
        oldest = min(rows, key=lambda row: row.id, default=None)
        return Stats(
            pending=len(rows),
            due=sum(row.available_at <= now for row in rows),
            in_flight=sum(_leased(row, now) for row in rows),
            dead=dead,
            oldest_pending_seconds=None
            if oldest is None
            else max(0.0, now - oldest.created_at),
        )

    def summary(self, groups: int = 20) -> Summary:
        """Totals, the oldest age and the ``groups`` largest backlogs by task name and queue."""
        stats = self.stats()
        with self.tables.lock:
            now = self.tables.clock()
            rows = list(self.tables.rows.values())
        waiting = sum(
            row.attempts > 0 and row.lease_token is None and row.available_at > now
            for row in rows
        )
        by_group: dict[tuple[str, str], list[Row]] = {}
        for row in rows:
            key = (row.envelope.task_name, row.envelope.queue)
            by_group.setdefault(key, []).append(row)
        ranked = sorted(by_group.items(), key=lambda item: (-len(item[1]), item[0]))
        backlog = tuple(
            BacklogGroup(
                name,
                queue,
                len(members),
                sum(row.available_at <= now for row in members),
                max(0.0, now - min(row.created_at for row in members)),
            )
            for (name, queue), members in ranked[:groups]
        )
        return Summary(
            pending=stats.pending,
            due=stats.due,
            retrying=waiting,
            in_flight=stats.in_flight,
            dead=stats.dead,
            oldest_pending_seconds=stats.oldest_pending_seconds,
            backlog=backlog,
        )

    def top_failures(self, limit: int = 10) -> TopFailures:
        """The ``limit`` task names with most refused rows, and with most dead letters."""
        with self.tables.lock:
            rows = list(self.tables.rows.values())
            dead = list(self.tables.dead.values())
        refused: dict[str, list[int]] = {}
        for row in rows:
            if row.attempts > 0 or row.last_error:
                refused.setdefault(row.envelope.task_name, []).append(row.attempts)
        retrying = sorted(
            (
                RetryingTask(name, len(attempts), sum(attempts), max(attempts))
                for name, attempts in refused.items()
            ),
            key=lambda task: (-task.rows, task.task_name),
        )
        counts = Counter(letter.envelope.task_name for letter in dead)
        dead_tasks = sorted(
            (DeadTask(name, count) for name, count in counts.items()),
            key=lambda task: (-task.dead, task.task_name),
        )
        return TopFailures(tuple(retrying[:limit]), tuple(dead_tasks[:limit]))

    def retry_now(self, ids: Sequence[int]) -> list[int]:
        """Make the given rows due now; rows leased to a relay are left alone."""

        def due_now(row: Row, now: float) -> None:
            self.tables.rows[row.id] = replace(row, available_at=now)

        return self._each_unleased(ids, due_now)

    def move_to_dead_letters(self, ids: Sequence[int], reason: str) -> list[int]:
        """Move the given rows to the dead letters with ``reason``; leased rows stay."""

        def bury(row: Row, now: float) -> None:
            self.tables.bury(row, row.attempts, reason, now)

        return self._each_unleased(ids, bury)

    def replay_dead_letters(
        self,
        selection: DeadLetterFilter,
        *,
        dry_run: bool = False,
        chunk_size: int = OPERATOR_CHUNK,
        progress: Progress | None = None,
    ) -> ReplayReport:
        """Put matching dead letters back into the outbox, due now, with attempts reset."""
        with self.tables.lock:
            matching = [
                letter
                for letter in self.tables.dead.values()
                if _selected(letter, selection)
            ]
        counts = Counter(letter.envelope.task_name for letter in matching)
        total = len(matching)
        if dry_run or not total:
            return ReplayReport(total, 0, dry_run, dict(sorted(counts.items())))
        replayed: Counter[str] = Counter()
        replayed_ids: list[int] = []
        ordered = sorted(letter.id for letter in matching)
        for start in range(0, total, chunk_size):
            with self.tables.lock:
                now = self.tables.clock()
                held = [
                    self.tables.dead.pop(dead_id)
                    for dead_id in ordered[start : start + chunk_size]
                    if dead_id in self.tables.dead
                ]
                self.tables.add_rows((letter.envelope for letter in held), now)
            replayed.update(letter.envelope.task_name for letter in held)
            replayed_ids.extend(letter.id for letter in held)
            if progress is not None:
                progress(len(replayed_ids), total)
        return ReplayReport(
            total,
            len(replayed_ids),
            False,
            dict(sorted(replayed.items())),
            tuple(replayed_ids),
        )

    def purge_dead_letters(
        self,
        older_than: float,
        *,
        task: str | None = None,
        dry_run: bool = False,
        chunk_size: int = 1000,
    ) -> PurgeReport:
        """Delete dead letters that died more than ``older_than`` seconds ago.

        ``task`` limits the purge to task names matching a glob. ``chunk_size`` is
        taken for the Django version's sake: memory deletes all at once.
        """
        with self.tables.lock:
            cutoff = self.tables.clock() - older_than
            matching = [
                letter.id
                for letter in self.tables.dead.values()
                if letter.dead_at < cutoff
                and (
                    task is None or fnmatch.fnmatchcase(letter.envelope.task_name, task)
                )
            ]
            if dry_run or not matching:
                return PurgeReport(len(matching), 0, dry_run)
            for dead_id in matching:
                del self.tables.dead[dead_id]
        return PurgeReport(len(matching), len(matching), False)

    def delete_dead_letters(self, ids: Sequence[int]) -> list[int]:
        """Delete the given dead letters; returns the ids that existed and were deleted."""
        deleted: list[int] = []
        with self.tables.lock:
            for chunk in id_chunks(ids):
                found = sorted(i for i in chunk if i in self.tables.dead)
                for dead_id in found:
                    del self.tables.dead[dead_id]
                deleted.extend(found)
        return deleted

    def _each_unleased(
        self, ids: Iterable[int], change: Callable[[Row, float], None]
    ) -> list[int]:
        """Apply ``change`` to the rows among ``ids`` no relay holds; their ids."""
        changed: list[int] = []
        with self.tables.lock:
            now = self.tables.clock()
            for chunk in id_chunks(list(ids)):
                for row_id in sorted(chunk):
                    row = self.tables.rows.get(row_id)
                    if row is not None and not _leased(row, now):
                        change(row, now)
                        changed.append(row_id)
        return changed


def _leased(row: Row, now: float) -> bool:
    """Whether a relay holds the row: a lease token and a lease not yet ended."""
    return row.lease_token is not None and row.available_at > now


def _selected(letter: DeadRow, selection: DeadLetterFilter) -> bool:
    """Whether a dead letter meets every condition of ``selection``."""
    if selection.ids is not None and letter.id not in selection.ids:
        return False
    name = letter.envelope.task_name
    if selection.task is not None and not fnmatch.fnmatchcase(name, selection.task):
        return False
    if selection.since is not None and letter.dead_at < _seconds(selection.since):
        return False
    return selection.until is None or letter.dead_at < _seconds(selection.until)


def _seconds(moment: datetime) -> float:
    """A moment as seconds since the epoch; a naive one is taken as UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


if TYPE_CHECKING:  # mypy checks here that the twin implements the interface
    from .protocol import OperatorStore

    _operator: type[OperatorStore] = InMemoryOperatorQueries
