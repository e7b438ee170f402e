"""Flow control's state in the outbox's database: a row per flow, publish records.

:meth:`FlowQueries.reserve` is the gate's one transaction per flow and batch: lock
the flow's row (relays take turns per flow), read how much of each rate's window the
records use, decide with :func:`~celery_outbox.flow_limits.grant`, record what will be
published -- before it is sent, so that a relay killed mid-batch can only have
counted too much -- and delete the records past the longest window. Every time is
the database's, taken by the statements that run after the lock is held.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from django.db import transaction

from ..flow_limits import (
    HELD_PREFIX,
    Candidate,
    Decided,
    Flow,
    FlowStats,
    Grant,
    Holding,
    KeyStats,
    KeyUse,
    Limits,
    Rate,
    Unstarted,
    Use,
    by_key,
    flow_of,
    frees_a_place,
    grant,
    holder,
    limits_in_force,
    outlived,
    rates_in_force,
    rates_text,
    stale,
    waiting_reason,
)
from ..states import PARKED
from .base import StoreBase
from .dialects import (
    FLOW_RECORD_TABLE,
    FLOW_SLOT_TABLE,
    FLOW_TABLE,
    MESSAGE_TABLE,
    placeholders,
)

#: The window of ``published_last_minute``.
MINUTE = 60.0
#: The busiest keys ``outbox flows stats`` shows per flow.
TOP_KEYS = 10
#: Rows changed by one statement when a reconciliation releases them.
RELEASE_CHUNK = 500
#: Rows read at a time while a report looks for its flow's waiting rows of a key
#: past the other flows' rows of the same key.
WAKE_PAGE = 100


class FlowQueries(StoreBase):
    """The flow rows and their publish records on one alias."""

    def reserve(self, flow: Flow, wanted: int) -> Grant:
        """Grant up to ``wanted`` publishes of ``flow`` now, and record them."""
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            changed, paced_for, _ = self._lock(cursor, flow.name)
            return self._grant(cursor, flow, changed, paced_for, wanted)

    def decide(
        self, flow: Flow, candidates: Sequence[Candidate], token: str
    ) -> Decided:
        """Decide for a batch's rows of ``flow`` (claimed under ``token``): their
        keys' limits, then the rates; take a slot for each row that goes, and put
        the rows whose key is at a limit back to wait for a slot, in this
        transaction, so that a worker's report that frees a slot finds them."""
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            changed, paced_for, stored = self._lock(cursor, flow.name)
            limits = limits_in_force(flow, stored)
            keys = sorted({c.key for c in candidates if c.key is not None})
            uses, overdue = (
                self._key_uses(cursor, flow.name, keys, [c.task_id for c in candidates])
                if limits and keys
                else ({}, ())
            )
            found = by_key(candidates, limits, uses) if limits else None
            free = found.free if found is not None else tuple(candidates)
            granted = self._grant(cursor, flow, changed, paced_for, len(free))
            going = [c for c in free[: granted.granted] if c.key is not None]
            if limits and going:
                self._take_slots(cursor, flow, going)
            waiting = found.waiting if found is not None else ()
            if waiting:
                self._park(cursor, flow.name, waiting, token, flow.lease)
        return Decided(
            granted,
            tuple(c.id for c in free),
            tuple(c.id for c in waiting),
            overdue,
        )

    def task_started(self, flow: Flow, key: str, task_id: str) -> int:
        """A task of ``key`` started on a worker: its slot no longer counts as
        queued and its lease counts from now (made again if it had expired or was
        freed: it runs), and with a ``queued`` limit one parked row of the key is
        woken. A task id may hold two slots (a retry published before its run's
        end was reported): the start is the unstarted one's."""
        with self._report(flow) as (cursor, stored):
            found = self._slot_of(cursor, flow, task_id, started_first=False)
            if found is None:
                self._take_slots(
                    cursor, flow, [Candidate(0, key, task_id)], started=True
                )
                return 0
            self._renew(cursor, flow, found[0], started=True)
            if limits_in_force(flow, stored).of(key).queued is None:
                return 0
            return self._wake(cursor, flow, key, 1)

    def task_ended(self, flow: Flow, key: str, task_id: str) -> int:
        """A task of ``key`` ended (however: done, failed, retried, revoked, lost):
        its slot frees, and a row of the key that waited for it is woken."""
        with self._report(flow) as (cursor, stored):
            # One run ended: one slot frees, the started one first (a retry
            # published before this report holds a slot of its own, not started).
            found = self._slot_of(cursor, flow, task_id, started_first=True)
            started = [] if found is None else [found[1]]
            if found is not None:
                cursor.execute(
                    f"DELETE FROM {FLOW_SLOT_TABLE} WHERE id = %s", [found[0]]
                )
            if not frees_a_place(limits_in_force(flow, stored), key, started):
                return 0
            return self._wake(cursor, flow, key, max(len(started), 1))

    def task_requeued(self, flow: Flow, key: str, task_id: str) -> int:
        """A run of ``key`` ended and put its task back in the broker
        (``Reject(requeue=True)``, a time limit's requeue): the task is published
        and not finished, so its slot stays, queued again, its lease from now
        (taken again if it had expired). Freed, its place would go to the key's
        next task while this one runs again: one more than ``running`` at once."""
        with self._report(flow) as (cursor, _):
            found = self._slot_of(cursor, flow, task_id, started_first=True)
            if found is None:
                self._take_slots(cursor, flow, [Candidate(0, key, task_id)])
                return 0
            self._renew(cursor, flow, found[0], started=False)
            return 0

    def _renew(self, cursor: Any, flow: Flow, slot: int, *, started: bool) -> None:
        """The slot ``slot`` started (or queued again), its lease from now."""
        until_sql, until_params = self.dialect.after(flow.lease)
        cursor.execute(
            f"UPDATE {FLOW_SLOT_TABLE} SET started = %s, expires_at = {until_sql} "
            f"WHERE id = %s",
            [started, *until_params, slot],
        )

    def not_published(self, flow: Flow, rows: Sequence[Candidate]) -> int:
        """``rows`` took a slot of their key and did not reach the broker (refused,
        dead-lettered, put back): their unstarted slots free, and for each one
        freed a row of its key that waited is woken; how many were woken. The
        relay knows first: no worker will report a task it never received."""
        task_ids = [c.task_id for c in rows if c.key is not None]
        if not task_ids:
            return 0
        with self._report(flow) as (cursor, _):
            cursor.execute(
                f"SELECT flow_key, COUNT(*) FROM {FLOW_SLOT_TABLE} WHERE flow = %s "
                f"AND started = %s AND task_id IN ({placeholders(task_ids)}) "
                f"GROUP BY flow_key",
                [flow.name, False, *task_ids],
            )
            freed = sorted((str(key), int(count)) for key, count in cursor.fetchall())
            if not freed:
                return 0
            cursor.execute(
                f"DELETE FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND started = %s AND "
                f"task_id IN ({placeholders(task_ids)})",
                [flow.name, False, *task_ids],
            )
            return sum(self._wake(cursor, flow, key, count) for key, count in freed)

    @contextlib.contextmanager
    def _report(self, flow: Flow) -> Iterator[tuple[Any, str | None]]:
        """A worker's report's transaction, under the flow's row lock (the one the
        relays decide under: a report never misses a row a decision is parking);
        its cursor and the operator's limits."""
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            _, _, stored = self._lock(cursor, flow.name)
            yield cursor, stored

    def _slot_of(
        self, cursor: Any, flow: Flow, task_id: str, *, started_first: bool
    ) -> tuple[int, bool] | None:
        """One slot of ``task_id`` (the started or the unstarted one first) and
        whether it started; None when it holds none."""
        order = "DESC" if started_first else "ASC"
        cursor.execute(
            f"SELECT id, started FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND "
            f"task_id = %s ORDER BY started {order}, id LIMIT 1",
            [flow.name, task_id],
        )
        row = cursor.fetchone()
        return None if row is None else (int(row[0]), bool(row[1]))

    def set_limits(self, name: str, limits: Limits | None) -> None:
        """Put ``limits`` in force for the flow ``name`` at once, on every relay;
        None goes back to the settings' limits. The flow's waiting rows are woken
        (a raised limit takes them at the next decision); other flows' are not."""
        text = limits.text() if limits is not None else None
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            self._change(cursor, name, "limits", text)
            # Read first, then change by id: an UPDATE that searched the table would
            # lock every row it read on MySQL.
            cursor.execute(
                f"SELECT id, flow_key, last_error FROM {MESSAGE_TABLE} WHERE "
                f"flow_key IS NOT NULL AND state = '{PARKED}'",
                [],
            )
            mine = [
                int(i)
                for i, key, error in cursor.fetchall()
                if error == waiting_reason(name, str(key))
            ]
            self._wake_ids(cursor, mine)

    def reconcile(self, flows: Sequence[Flow]) -> dict[str, int]:
        """Release, due now, the rows a flow parked or held that no flow of
        ``flows`` (the settings) holds so any more (:func:`stale`): each once,
        however many relays start at once; how many, by the flow that held them."""
        now = self.dialect.now()
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            cursor.execute(f"SELECT name, rates FROM {FLOW_TABLE}", [])
            rates = {
                str(n): None if r is None else str(r) for n, r in cursor.fetchall()
            }
            cursor.execute(
                f"SELECT id, task_name, flow_key, last_error, state FROM "
                f"{MESSAGE_TABLE} WHERE available_at > {now} AND lease_token IS NULL "
                f"AND (state = '{PARKED}' OR (state IS NULL AND SUBSTR(last_error, 1, "
                f"{len(HELD_PREFIX)}) = '{HELD_PREFIX}'))",
                [],
            )
            holdings = []
            for row_id, task, key, error, state in cursor.fetchall():
                parked = state == PARKED
                name = holder(str(error or ""), str(key) if parked else None)
                if name is not None:
                    holdings.append(Holding(int(row_id), str(task), name, parked))
            by_flow: dict[str, list[Holding]] = {}
            for row in stale(tuple(flows), holdings, rates):
                by_flow.setdefault(row.flow, []).append(row)
            released = {
                name: self._release(cursor, rows)
                for name, rows in sorted(by_flow.items())
            }
        return {name: count for name, count in released.items() if count}

    def _release(self, cursor: Any, rows: Sequence[Holding]) -> int:
        """Make ``rows`` due now, those still parked or held and not leased (a
        relay that released them first, or claimed them since, keeps them)."""
        done = 0
        for parked in (True, False):
            ids = [r.id for r in rows if r.parked == parked]
            for start in range(0, len(ids), RELEASE_CHUNK):
                chunk = ids[start : start + RELEASE_CHUNK]
                if parked:
                    done += self._wake_ids(cursor, chunk)
                    continue
                now = self.dialect.now()
                cursor.execute(
                    f"UPDATE {MESSAGE_TABLE} SET available_at = {now} WHERE id IN "
                    f"({placeholders(chunk)}) AND state IS NULL AND lease_token IS "
                    f"NULL AND available_at > {now}",
                    chunk,
                )
                done += int(cursor.rowcount)
                self._wake_relays(cursor, int(cursor.rowcount))
        return done

    def _grant(
        self,
        cursor: Any,
        flow: Flow,
        changed: str | None,
        paced_for: float,
        wanted: int,
    ) -> Grant:
        """The rates' grant of ``wanted`` (all of it with no rate), recorded."""
        dialect = self.dialect
        rates = rates_in_force(flow, changed)
        uses = self._uses(cursor, flow.name, rates) if rates else []
        granted = grant(uses, wanted, paced_for)
        if granted.held:
            paced_sql, paced_params = dialect.after(granted.paced_for, clock=True)
            cursor.execute(
                f"UPDATE {FLOW_TABLE} SET paced_until = {paced_sql} WHERE name = %s",
                [*paced_params, flow.name],
            )
        if granted.granted:
            cursor.execute(
                f"INSERT INTO {FLOW_RECORD_TABLE} (flow, at, tasks) "
                f"VALUES (%s, {dialect.clock()}, %s)",
                [flow.name, granted.granted],
            )
        # Kept a minute at least: the stats' publishes of the last minute.
        longest = max((r.seconds for r in (*rates, *flow.rates)), default=0.0)
        before_sql, before_params = dialect.after(-max(longest, MINUTE), clock=True)
        cursor.execute(
            f"DELETE FROM {FLOW_RECORD_TABLE} WHERE flow = %s AND at <= {before_sql}",
            [flow.name, *before_params],
        )
        return granted

    def _key_uses(
        self, cursor: Any, name: str, keys: Sequence[str], deciding: Sequence[str]
    ) -> tuple[dict[str, KeyUse], tuple[str, ...]]:
        """The slots each of ``keys`` holds, and the queues of the flow's unstarted
        slots past their lease (counted until the gate learns whether their queue
        still holds them); started slots past their lease deleted first.

        The unstarted slots of the tasks being decided (``deciding``: their task
        ids) do not count: a row whose publish failed comes back with its slot
        still taken, and would otherwise wait behind itself until the lease. A
        started one does: a retry's row comes before its run reports its end.
        """
        now = self.dialect.now()
        cursor.execute(
            f"DELETE FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND started = %s AND "
            f"expires_at <= {now}",
            [name, True],
        )
        cursor.execute(
            f"SELECT DISTINCT queue FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND "
            f"started = %s AND expires_at <= {now}",
            [name, False],
        )
        overdue = tuple(sorted(str(queue) for (queue,) in cursor.fetchall()))
        cursor.execute(
            f"SELECT flow_key, COUNT(*), SUM(CASE WHEN started = %s THEN 0 ELSE 1 END) "
            f"FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND flow_key IN "
            f"({placeholders(keys)}) AND (started = %s OR task_id NOT IN "
            f"({placeholders(deciding)})) GROUP BY flow_key",
            [True, name, *keys, True, *deciding],
        )
        uses = {
            str(key): KeyUse(int(running), int(queued or 0))
            for key, running, queued in cursor.fetchall()
        }
        return uses, overdue

    def outlived(self, flow: Flow, depths: Mapping[str, int] | None) -> int:
        """Settle ``flow``'s unstarted slots past their lease by what their queues
        hold (``depths``, by :func:`~celery_outbox.flow_limits.outlived`): a slot
        whose task still waits stays, its lease from now; the others free, and a
        parked row of the key is woken for each; how many freed."""
        now = self.dialect.now()
        with self._report(flow) as (cursor, _):
            cursor.execute(
                f"SELECT id, flow_key, queue, CASE WHEN expires_at <= {now} THEN 1 "
                f"ELSE 0 END FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND started = %s",
                [flow.name, False],
            )
            slots = [
                Unstarted(int(i), str(key), str(queue), bool(int(overdue)))
                for i, key, queue, overdue in cursor.fetchall()
            ]
            keep, free = outlived(slots, depths)
            for start in range(0, len(keep), RELEASE_CHUNK):
                ids = [slot.id for slot in keep[start : start + RELEASE_CHUNK]]
                until_sql, until_params = self.dialect.after(flow.lease)
                cursor.execute(
                    f"UPDATE {FLOW_SLOT_TABLE} SET expires_at = {until_sql} WHERE id "
                    f"IN ({placeholders(ids)})",
                    [*until_params, *ids],
                )
            for start in range(0, len(free), RELEASE_CHUNK):
                ids = [slot.id for slot in free[start : start + RELEASE_CHUNK]]
                cursor.execute(
                    f"DELETE FROM {FLOW_SLOT_TABLE} WHERE id IN ({placeholders(ids)})",
                    ids,
                )
            for key, count in sorted(Counter(slot.key for slot in free).items()):
                self._wake(cursor, flow, key, count)
        return len(free)

    def _take_slots(
        self,
        cursor: Any,
        flow: Flow,
        going: Sequence[Candidate],
        *,
        started: bool = False,
    ) -> None:
        """A slot for each row that goes (a row published again takes its own
        unstarted slot again, not a second one; a started one is its run's, which
        its end report frees)."""
        task_ids = [c.task_id for c in going]
        cursor.execute(
            f"DELETE FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND started = %s AND "
            f"task_id IN ({placeholders(task_ids)})",
            [flow.name, False, *task_ids],
        )
        until_sql, until_params = self.dialect.after(flow.lease)
        values = ", ".join([f"(%s, %s, %s, %s, %s, {until_sql})"] * len(going))
        params: list[Any] = []
        for c in going:
            params.extend(
                [flow.name, c.key, c.task_id, c.queue, started, *until_params]
            )
        cursor.execute(
            f"INSERT INTO {FLOW_SLOT_TABLE} (flow, flow_key, task_id, queue, started, "
            f"expires_at) VALUES {values}",
            params,
        )

    def _park(
        self,
        cursor: Any,
        name: str,
        waiting: Sequence[Candidate],
        token: str,
        lease: float,
    ) -> None:
        """Put rows back (this claim's: fenced by ``token``) to wait for a slot of
        their key: a report wakes them; without one they come back when the key's
        first slot would free by its lease (the lease of a slot whose task started
        counts from the start: a row back too early waits again until then only),
        or after the lease when the key holds none. A slot already past its lease
        is settled by the gate next (:meth:`outlived`), which wakes a row for it."""
        after_sql, after_params = self.dialect.after(lease)
        now = self.dialect.now()
        by_key: dict[str, list[int]] = {}
        for c in waiting:
            by_key.setdefault(str(c.key), []).append(c.id)
        for key, ids in sorted(by_key.items()):
            cursor.execute(
                f"UPDATE {MESSAGE_TABLE} SET state = '{PARKED}', flow_key = %s, "
                f"last_error = %s, available_at = COALESCE((SELECT MIN(expires_at) "
                f"FROM {FLOW_SLOT_TABLE} WHERE flow = %s AND flow_key = %s AND "
                f"expires_at > {now}), "
                f"{after_sql}), lease_token = NULL, holder = NULL WHERE lease_token "
                f"= %s AND id IN ({placeholders(ids)})",
                [key, waiting_reason(name, key), name, key, *after_params, token, *ids],
            )

    def _wake(self, cursor: Any, flow: Flow, key: str, count: int) -> int:
        """Make the first ``count`` rows of ``flow`` waiting for a slot of ``key`` due
        now. A key may be a key of other flows too (a tenant's id): their rows wait
        for their own flow's slots and are passed over, in pages of the key's rows
        in id order (the first page is the one row wanted when no other flow waits).

        Plain reads (no lock on the index range, which on MySQL would hold off the
        enqueues next to it): the flow's row lock keeps reports of one flow from
        waking the same rows, and the UPDATE changes only rows still parked.
        """
        ids: list[int] = []
        after, page = 0, count
        while len(ids) < count:
            cursor.execute(
                f"SELECT id, task_name FROM {MESSAGE_TABLE} WHERE flow_key = %s AND "
                f"state = '{PARKED}' AND lease_token IS NULL AND id > %s ORDER BY id "
                f"LIMIT %s",
                [key, after, page],
            )
            rows = cursor.fetchall()
            ids.extend(int(i) for i, task in rows if flow.covers(str(task)))
            if len(rows) < page:
                break
            after, page = int(rows[-1][0]), WAKE_PAGE
        return self._wake_ids(cursor, ids[:count])

    def _wake_ids(self, cursor: Any, ids: Sequence[int]) -> int:
        """Make the parked rows ``ids`` due now; how many were still parked (a row
        claimed again once its lease passed is a relay's: left alone)."""
        if not ids:
            return 0
        cursor.execute(
            f"UPDATE {MESSAGE_TABLE} SET state = NULL, flow_key = NULL, available_at "
            f"= {self.dialect.now()} WHERE id IN ({placeholders(ids)}) AND state = "
            f"'{PARKED}' AND lease_token IS NULL",
            ids,
        )
        woken = int(cursor.rowcount)
        self._wake_relays(cursor, woken)
        return woken

    def set_rates(self, name: str, rates: Sequence[Rate] | None) -> None:
        """Put ``rates`` in force for the flow ``name`` at once, on every relay;
        None goes back to the settings' rates."""
        text = rates_text(rates) if rates else None
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            # The rows held so far keep their places; the next ones pace at the new rate.
            self._change(cursor, name, "rates", text)

    def flow_stats(self, flows: Sequence[Flow]) -> tuple[FlowStats, ...]:
        """Each flow's rows waiting, its publishes of the last minute, its limits,
        its running tasks and its busiest keys; then each flow no longer
        configured that has parked rows left."""
        since_sql, since_params = self.dialect.after(-MINUTE, clock=True)
        now = self.dialect.now()
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT name, rates, limits FROM {FLOW_TABLE}", [])
            rows = cursor.fetchall()
            changed = {str(name): rates for name, rates, _ in rows}
            limits = {str(name): stored for name, _, stored in rows}
            cursor.execute(
                f"SELECT flow, SUM(tasks) FROM {FLOW_RECORD_TABLE} "
                f"WHERE at > {since_sql} GROUP BY flow",
                since_params,
            )
            recent = {str(name): int(count) for name, count in cursor.fetchall()}
            cursor.execute(
                f"SELECT task_name, COUNT(*) FROM {MESSAGE_TABLE} GROUP BY task_name",
                [],
            )
            by_task = [(str(name), int(count)) for name, count in cursor.fetchall()]
            cursor.execute(
                f"SELECT flow, flow_key, COUNT(*), SUM(CASE WHEN started = %s THEN 0 "
                f"ELSE 1 END) FROM {FLOW_SLOT_TABLE} WHERE started = %s OR "
                f"expires_at > {now} GROUP BY flow, flow_key",
                [True, False],
            )
            slots = [
                (str(f), str(k), int(n), int(q or 0))
                for f, k, n, q in cursor.fetchall()
            ]
            cursor.execute(
                f"SELECT flow_key, last_error, COUNT(*) FROM {MESSAGE_TABLE} WHERE "
                f"state = '{PARKED}' GROUP BY flow_key, last_error",
                [],
            )
            parked = parked_by_flow(
                (str(k), str(e or ""), int(n)) for k, e, n in cursor.fetchall()
            )
        return flow_stats(flows, changed, recent, by_task, limits, slots, parked)

    def _change(self, cursor: Any, name: str, column: str, text: str | None) -> None:
        """An operator's ``rates`` or ``limits`` for the flow ``name`` (its row
        locked, made if missing); None: the settings' again."""
        self._lock(cursor, name)
        cursor.execute(
            f"UPDATE {FLOW_TABLE} SET {column} = %s, changed_at = {self.dialect.now()} "
            f"WHERE name = %s",
            [text, name],
        )

    def _lock(self, cursor: Any, name: str) -> tuple[str | None, float, str | None]:
        """Lock the flow's row (made if missing); the operator's rates it holds, the
        seconds until the slots of the rows held so far are taken, and the
        operator's limits.

        An UPDATE locks on every vendor: the row on PostgreSQL and MySQL, the
        database's one writer on SQLite (where a SELECT ... FOR UPDATE does not
        exist, and a read first would let two writers in).
        """
        for _ in range(2):
            cursor.execute(
                f"UPDATE {FLOW_TABLE} SET name = name WHERE name = %s", [name]
            )
            age = self.dialect.age_seconds("paced_until", clock=True)
            cursor.execute(
                f"SELECT rates, {age}, limits FROM {FLOW_TABLE} WHERE name = %s",
                [name],
            )
            row = cursor.fetchone()
            if row is not None:
                rates = None if row[0] is None else str(row[0])
                limits = None if row[2] is None else str(row[2])
                return rates, 0.0 if row[1] is None else -float(row[1]), limits
            cursor.execute(
                self.dialect.insert_missing(FLOW_TABLE, "name", ("name", "rates")),
                [name, None],
            )
        raise AssertionError(f"the row of flow {name!r} was inserted, then not found")

    def _uses(self, cursor: Any, name: str, rates: Sequence[Rate]) -> list[Use]:
        """Each rate's use of its window, in one statement over the (flow, at) index."""
        dialect = self.dialect
        age = dialect.age_seconds("at", clock=True)
        parts: list[str] = []
        params: list[Any] = []
        for rate in rates:
            inside_sql, inside_params = dialect.after(-rate.seconds, clock=True)
            parts.append(f"SUM(CASE WHEN at > {inside_sql} THEN tasks ELSE 0 END)")
            parts.append(f"MAX(CASE WHEN at > {inside_sql} THEN {age} END)")
            params.extend([*inside_params, *inside_params])
        longest_sql, longest_params = dialect.after(
            -max(rate.seconds for rate in rates), clock=True
        )
        cursor.execute(
            f"SELECT {', '.join(parts)} FROM {FLOW_RECORD_TABLE} "
            f"WHERE flow = %s AND at > {longest_sql}",
            [*params, name, *longest_params],
        )
        row = cursor.fetchone()
        uses = []
        for index, rate in enumerate(rates):
            used, oldest = row[2 * index], row[2 * index + 1]
            uses.append(
                Use(
                    rate,
                    int(used or 0),
                    None if oldest is None else max(0.0, float(oldest)),
                )
            )
        return uses


def parked_by_flow(
    rows: Iterable[tuple[str, str, int]],
) -> list[tuple[str, str, int]]:
    """``(flow, key, rows)`` of the parked rows counted as ``(key, last_error,
    rows)``: by the flow that parked them (its name in ``last_error``), configured
    or not; ``""`` when none is named."""
    found: dict[tuple[str, str], int] = {}
    for key, error, count in rows:
        name = holder(error, key) or ""
        found[(name, key)] = found.get((name, key), 0) + count
    return [(name, key, n) for (name, key), n in sorted(found.items())]


def flow_stats(
    flows: Sequence[Flow],
    changed: dict[str, str | None],
    recent: dict[str, int],
    by_task: Sequence[tuple[str, int]],
    limits: dict[str, str | None] | None = None,
    slots: Sequence[tuple[str, str, int, int]] = (),
    parked: Sequence[tuple[str, str, int]] = (),
) -> tuple[FlowStats, ...]:
    """The stats of ``flows`` from the operator's rates and limits by flow, the
    publishes of the last minute by flow, the outbox's rows by task name, the
    slots ``(flow, key, running, queued)`` and the parked rows ``(flow that
    parked them, key, rows)``; then a flow no longer configured that still has
    parked rows (``configured`` False: a relay's start releases them)."""
    limits = limits or {}
    waiting = dict.fromkeys((flow.name for flow in flows), 0)
    every = tuple(flows)
    for task_name, count in by_task:
        found = flow_of(every, task_name)
        if found is not None:
            waiting[found.name] += count
    keys: dict[str, dict[str, list[int]]] = {flow.name: {} for flow in flows}
    for name, key, running, queued in slots:
        if name in keys:
            keys[name].setdefault(key, [0, 0, 0])[:2] = [running, queued]
    gone: dict[str, dict[str, list[int]]] = {}
    for name, key, count in parked:
        lanes = keys[name] if name in keys else gone.setdefault(name, {})
        lanes.setdefault(key, [0, 0, 0])[2] += count
    stats = []
    for flow in flows:
        in_force = limits_in_force(flow, limits.get(flow.name))
        stats.append(
            _stats(
                flow,
                rates_in_force(flow, changed.get(flow.name)),
                bool(changed.get(flow.name)),
                waiting[flow.name],
                recent.get(flow.name, 0),
                in_force,
                bool(limits.get(flow.name)),
                keys[flow.name],
            )
        )
    for name, lanes in sorted(gone.items()):
        old = Flow(name, ())
        stats.append(
            dataclasses.replace(
                _stats(old, (), False, 0, recent.get(name, 0), Limits(), False, lanes),
                configured=False,
            )
        )
    return tuple(stats)


def _stats(
    flow: Flow,
    rates: tuple[Rate, ...],
    changed: bool,
    waiting: int,
    recent: int,
    in_force: Limits,
    limits_changed: bool,
    by_key_: dict[str, list[int]],
) -> FlowStats:
    busiest = sorted(by_key_.items(), key=lambda kv: (-kv[1][0], -kv[1][2], kv[0]))
    return FlowStats(
        flow.name,
        flow.tasks,
        rates,
        changed,
        waiting,
        recent,
        in_force,
        limits_changed,
        sum(v[0] for v in by_key_.values()),
        sum(v[1] for v in by_key_.values()),
        tuple(
            KeyStats(key, r, q, w, in_force.of(key))
            for key, (r, q, w) in busiest[:TOP_KEYS]
        ),
        parked=sum(v[2] for v in by_key_.values()),
    )
