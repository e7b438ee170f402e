"""Flow control's state in the outbox's database: a row per flow, publish records.

:meth:`FlowQueries.reserve` is the gate's one transaction per flow and batch: lock
the flow's row (relays take turns per flow), read how much of each rate's window the
records use, decide with :func:`~celery_outbox.flow.core.grant`, record what will be
published -- before it is sent, so that a relay killed mid-batch can only have
counted too much -- and delete the records past the longest window. Every time is
the database's, taken by the statements that run after the lock is held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import transaction

from ..flow.core import (
    Flow,
    FlowStats,
    Grant,
    Rate,
    Use,
    flow_of,
    grant,
    rates_in_force,
    rates_text,
)
from .base import StoreBase
from .dialects import FLOW_RECORD_TABLE, FLOW_TABLE, MESSAGE_TABLE

#: The window of ``published_last_minute``.
MINUTE = 60.0


class FlowQueries(StoreBase):
    """The flow rows and their publish records on one alias."""

    def reserve(self, flow: Flow, wanted: int) -> Grant:
        """Grant up to ``wanted`` publishes of ``flow`` now, and record them."""
        dialect = self.dialect
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            changed, paced_for = self._lock(cursor, flow.name)
            rates = rates_in_force(flow, changed)
            uses = self._uses(cursor, flow.name, rates)
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
            longest = max(r.seconds for r in (*rates, *flow.rates))
            before_sql, before_params = dialect.after(-longest, clock=True)
            cursor.execute(
                f"DELETE FROM {FLOW_RECORD_TABLE} WHERE flow = %s AND at <= {before_sql}",
                [flow.name, *before_params],
            )
        return granted

    def set_rates(self, name: str, rates: Sequence[Rate] | None) -> None:
        """Put ``rates`` in force for the flow ``name`` at once, on every relay;
        None goes back to the settings' rates."""
        text = rates_text(rates) if rates else None
        with (
            self._translated(),
            transaction.atomic(using=self.alias),
            self.connection.cursor() as cursor,
        ):
            self._lock(cursor, name)
            # The rows held so far keep their slots; the next ones pace at the new rate.
            cursor.execute(
                f"UPDATE {FLOW_TABLE} SET rates = %s, changed_at = "
                f"{self.dialect.now()} WHERE name = %s",
                [text, name],
            )

    def flow_stats(self, flows: Sequence[Flow]) -> tuple[FlowStats, ...]:
        """Each flow's rows waiting, its publishes of the last minute, its rates."""
        if not flows:
            return ()
        since_sql, since_params = self.dialect.after(-MINUTE, clock=True)
        with self._translated(), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT name, rates FROM {FLOW_TABLE}", [])
            changed = {str(name): rates for name, rates in cursor.fetchall()}
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
        return flow_stats(flows, changed, recent, by_task)

    def _lock(self, cursor: Any, name: str) -> tuple[str | None, float]:
        """Lock the flow's row (made if missing); the operator's rates it holds, and
        the seconds until the slots of the rows held so far are taken.

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
                f"SELECT rates, {age} FROM {FLOW_TABLE} WHERE name = %s", [name]
            )
            row = cursor.fetchone()
            if row is not None:
                rates = None if row[0] is None else str(row[0])
                return rates, 0.0 if row[1] is None else -float(row[1])
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


def flow_stats(
    flows: Sequence[Flow],
    changed: dict[str, str | None],
    recent: dict[str, int],
    by_task: Sequence[tuple[str, int]],
) -> tuple[FlowStats, ...]:
    """The stats of ``flows`` from the operator's rates by flow, the publishes of
    the last minute by flow and the outbox's rows by task name."""
    waiting = dict.fromkeys((flow.name for flow in flows), 0)
    every = tuple(flows)
    for task_name, count in by_task:
        found = flow_of(every, task_name)
        if found is not None:
            waiting[found.name] += count
    return tuple(
        FlowStats(
            flow.name,
            flow.tasks,
            rates_in_force(flow, changed.get(flow.name)),
            bool(changed.get(flow.name)),
            waiting[flow.name],
            recent.get(flow.name, 0),
        )
        for flow in flows
    )
