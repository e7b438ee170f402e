"""An in-memory twin of :class:`~.flows.FlowQueries`: flow control without a database.

The same rules -- a decision per flow at a time, records written before the
publish, records past the longest window dropped -- on an injected clock, so a
test moves through windows without sleeping. Given the in-memory outbox's
:class:`~.memory.Tables`, its stats count the rows waiting there.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..flow_limits import (
    Candidate,
    Decided,
    Flow,
    FlowStats,
    Grant,
    Holding,
    KeyUse,
    Limits,
    Rate,
    Unstarted,
    by_key,
    frees_a_place,
    grant,
    holder,
    limits_in_force,
    outlived,
    rates_in_force,
    rates_text,
    stale,
    use_of,
    waiting_reason,
)
from .flows import MINUTE, flow_stats
from .memory import Tables

#: Slot ids, in the order slots are taken (a slot taken later has a larger one).
_SERIALS = itertools.count(1)


@dataclasses.dataclass
class _Slot:
    task_id: str
    key: str
    started: bool
    expires_at: float
    queue: str = ""
    id: int = dataclasses.field(default_factory=lambda: next(_SERIALS))


class InMemoryFlows:
    """Flow rows and publish records in dicts, behind one lock."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        tables: Tables | None = None,
    ) -> None:
        """``clock`` gives the records' times; ``tables`` (their clock wins) hold
        the outbox rows the stats count."""
        self.tables = tables
        self.clock = tables.clock if tables is not None else clock
        self._lock = threading.Lock()
        #: Operator's rates by flow name (``rates_text``).
        self.changed: dict[str, str | None] = {}
        #: ``(time, publishes)`` records by flow name, oldest first.
        self.records: dict[str, list[tuple[float, int]]] = {}
        #: When the slots of the rows held so far are taken, by flow name.
        self.paced_until: dict[str, float] = {}
        #: Operator's limits by flow name (``Limits.text``).
        self.limits: dict[str, str | None] = {}
        #: Slots by flow name, oldest first (a task id may hold two: a retry
        #: published before its run's end was reported).
        self.slots: dict[str, list[_Slot]] = {}
        #: Parked rows: (row id, task name, flow name) by flow key, oldest first.
        self.parked: dict[str, list[tuple[int, str, str]]] = {}

    def reserve(self, flow: Flow, wanted: int) -> Grant:
        """Grant up to ``wanted`` publishes of ``flow`` now, and record them."""
        with self._lock:
            return self._grant(flow, wanted, self.clock())

    def decide(
        self, flow: Flow, candidates: Sequence[Candidate], token: str
    ) -> Decided:
        """The keys' limits, then the rates; slots taken, waiting rows parked."""
        with self._lock:
            now = self.clock()
            limits = limits_in_force(flow, self.limits.get(flow.name))
            slots = self.slots.setdefault(flow.name, [])
            slots[:] = [s for s in slots if not s.started or s.expires_at > now]
            overdue = sorted({s.queue for s in slots if s.expires_at <= now})
            uses: dict[str, KeyUse] = {}
            deciding = {c.task_id for c in candidates}
            for slot in slots:
                if slot.task_id in deciding and not slot.started:
                    continue  # a failed publish's own slot
                use = uses.get(slot.key, KeyUse())
                uses[slot.key] = KeyUse(
                    use.running + 1, use.queued + (not slot.started)
                )
            found = by_key(candidates, limits, uses)
            granted = self._grant(flow, len(found.free), now)
            going = [c for c in found.free[: granted.granted] if c.key is not None]
            mine = {c.task_id for c in going}
            slots[:] = [s for s in slots if s.started or s.task_id not in mine]
            slots.extend(
                _Slot(c.task_id, str(c.key), False, now + flow.lease, c.queue)
                for c in going
            )
            self._park(flow, found.waiting, token, now)
        return Decided(
            granted,
            tuple(c.id for c in found.free),
            tuple(c.id for c in found.waiting),
            tuple(overdue),
        )

    def outlived(self, flow: Flow, depths: Mapping[str, int] | None) -> int:
        """Overdue unstarted slots whose queue still holds them stay, their lease
        from now; the others free, a parked row of the key woken for each."""
        with self._lock:
            now = self.clock()
            slots = self.slots.setdefault(flow.name, [])
            unstarted = {s.id: s for s in slots if not s.started}
            keep, free = outlived(
                [
                    Unstarted(s.id, s.key, s.queue, s.expires_at <= now)
                    for s in unstarted.values()
                ],
                depths,
            )
            for slot in keep:
                unstarted[slot.id].expires_at = now + flow.lease
            gone = {slot.id for slot in free}
            slots[:] = [s for s in slots if s.id not in gone]
            for key, count in sorted(Counter(slot.key for slot in free).items()):
                self._wake(flow.name, key, count, now)
        return len(free)

    def task_started(self, flow: Flow, key: str, task_id: str) -> int:
        """The slot is started (taken again if gone); with a queued limit, a wake."""
        with self._lock:
            now = self.clock()
            slots = self.slots.setdefault(flow.name, [])
            mine = sorted(
                (s for s in slots if s.task_id == task_id), key=lambda s: s.started
            )
            if not mine:
                slots.append(_Slot(task_id, key, True, now + flow.lease))
                return 0
            slot = mine[0]
            slot.started = True
            slot.expires_at = now + flow.lease
            limits = limits_in_force(flow, self.limits.get(flow.name))
            if limits.of(key).queued is None:
                return 0
            return self._wake(flow.name, key, 1, now)

    def task_ended(self, flow: Flow, key: str, task_id: str) -> int:
        """The slot frees; a parked row of the key is woken."""
        with self._lock:
            slots = self.slots.setdefault(flow.name, [])
            mine = sorted(
                (s for s in slots if s.task_id == task_id), key=lambda s: not s.started
            )
            if mine:
                slots.remove(mine[0])
            limits = limits_in_force(flow, self.limits.get(flow.name))
            started = [mine[0].started] if mine else []
            if not frees_a_place(limits, key, started):
                return 0
            return self._wake(flow.name, key, 1, self.clock())

    def task_requeued(self, flow: Flow, key: str, task_id: str) -> int:
        """The run's slot queued again (taken again if gone); nothing woken."""
        with self._lock:
            now = self.clock()
            slots = self.slots.setdefault(flow.name, [])
            mine = sorted(
                (s for s in slots if s.task_id == task_id), key=lambda s: not s.started
            )
            if not mine:
                slots.append(_Slot(task_id, key, False, now + flow.lease))
                return 0
            mine[0].started = False
            mine[0].expires_at = now + flow.lease
            return 0

    def not_published(self, flow: Flow, rows: Sequence[Candidate]) -> int:
        """Their unstarted slots free; a parked row of the key woken per slot."""
        mine = {c.task_id for c in rows if c.key is not None}
        with self._lock:
            slots = self.slots.setdefault(flow.name, [])
            freed = Counter(s.key for s in slots if s.task_id in mine and not s.started)
            slots[:] = [s for s in slots if s.started or s.task_id not in mine]
            now = self.clock()
            return sum(
                self._wake(flow.name, key, count, now)
                for key, count in sorted(freed.items())
            )

    def set_limits(self, name: str, limits: Limits | None) -> None:
        """Put ``limits`` in force for ``name``; parked rows woken."""
        with self._lock:
            self.limits[name] = limits.text() if limits is not None else None
            now = self.clock()
            for key, rows in list(self.parked.items()):
                self._wake(name, key, len(rows), now)

    def reconcile(self, flows: Sequence[Flow]) -> dict[str, int]:
        """Release the rows no flow of ``flows`` holds as they are held (those of
        the tables when given); how many, by the flow that held them."""
        with self._lock:
            now = self.clock()
            holdings = [
                Holding(row_id, task, name, True)
                for rows in self.parked.values()
                for row_id, task, name in rows
            ]
            holdings += self._held(now)
            released: Counter[str] = Counter()
            for row in stale(tuple(flows), holdings, self.changed):
                released[row.flow] += self._release(row, now)
        return {name: count for name, count in sorted(released.items()) if count}

    def _held(self, now: float) -> list[Holding]:
        """The tables' rows a flow's rates hold back, not leased."""
        if self.tables is None:
            return []
        found = []
        with self.tables.lock:
            for row in self.tables.rows.values():
                if row.lease_token is not None or row.available_at <= now:
                    continue
                name = holder(row.last_error, None)
                if name is not None:
                    found.append(Holding(row.id, row.envelope.task_name, name, False))
        return found

    def _release(self, held: Holding, now: float) -> int:
        """``held`` due now, unless a relay has it; 1 when released."""
        if held.parked:
            for key, rows in self.parked.items():
                mine = [row for row in rows if row[0] == held.id]
                if mine:
                    self.parked[key] = [row for row in rows if row not in mine]
                    break
            else:
                return 0
        if self.tables is None:
            return 1
        with self.tables.lock:
            row = self.tables.rows.get(held.id)
            if row is None or row.lease_token is not None:
                return 0
            self.tables.rows[held.id] = dataclasses.replace(row, available_at=now)
        return 1

    def _grant(self, flow: Flow, wanted: int, now: float) -> Grant:
        rates = rates_in_force(flow, self.changed.get(flow.name))
        records = self.records.setdefault(flow.name, [])
        uses = [use_of(records, rate, now) for rate in rates]
        paced_for = self.paced_until.get(flow.name, now) - now
        granted = grant(uses, wanted, paced_for)
        if granted.held:
            self.paced_until[flow.name] = now + granted.paced_for
        if granted.granted:
            records.append((now, granted.granted))
        longest = max((r.seconds for r in (*rates, *flow.rates)), default=0.0)
        records[:] = [(at, n) for at, n in records if at > now - max(longest, MINUTE)]
        return granted

    def _park(
        self, flow: Flow, waiting: Sequence[Candidate], token: str, now: float
    ) -> None:
        """Rows of this claim put back until a report wakes them, or the key's
        first slot frees by its lease (the flow's lease when it holds none)."""
        tables = self.tables
        slots = self.slots.get(flow.name, [])
        for c in waiting:
            key = str(c.key)
            back = min(
                (s.expires_at for s in slots if s.key == key and s.expires_at > now),
                default=now + flow.lease,
            )
            if tables is not None:
                with tables.lock:
                    row = tables.rows.get(c.id)
                    if row is None or row.lease_token != token:
                        continue
                    tables.rows[c.id] = dataclasses.replace(
                        row,
                        available_at=back,
                        lease_token=None,
                        last_error=waiting_reason(flow.name, key),
                    )
                    name = row.envelope.task_name
            else:
                name = ""
            self.parked.setdefault(key, []).append((c.id, name, flow.name))

    def _wake(self, flow: str, key: str, count: int, now: float) -> int:
        """The first ``count`` parked rows of ``flow`` and ``key`` due now (the
        key's rows of other flows wait for their own flow's slots)."""
        found = self.parked.get(key, [])
        woken = [row for row in found if row[2] == flow][:count]
        self.parked[key] = [row for row in found if row not in woken]
        if self.tables is not None:
            with self.tables.lock:
                for row_id, _, _ in woken:
                    row = self.tables.rows.get(row_id)
                    if row is not None and row.lease_token is None:
                        self.tables.rows[row_id] = dataclasses.replace(
                            row, available_at=now
                        )
        return len(woken)

    def set_rates(self, name: str, rates: Sequence[Rate] | None) -> None:
        """Put ``rates`` in force for ``name``; None goes back to the settings'."""
        with self._lock:
            self.changed[name] = rates_text(rates) if rates else None

    def flow_stats(self, flows: Sequence[Flow]) -> tuple[FlowStats, ...]:
        """Each flow's rows waiting, its publishes of the last minute, its rates."""
        with self._lock:
            now = self.clock()
            recent = {
                name: sum(n for at, n in records if at > now - MINUTE)
                for name, records in self.records.items()
            }
            changed = dict(self.changed)
            limits = dict(self.limits)
            slots: list[tuple[str, str, int, int]] = []
            for name, taken in self.slots.items():
                per_key: Counter[tuple[str, bool]] = Counter(
                    (slot.key, slot.started)
                    for slot in taken
                    if not slot.started or slot.expires_at > now
                )
                for key in sorted({k for k, _ in per_key}):
                    running = per_key[(key, True)] + per_key[(key, False)]
                    slots.append((name, key, running, per_key[(key, False)]))
            parked = Counter(
                (name, key) for key, rows in self.parked.items() for _, _, name in rows
            )
        by_task: Counter[str] = Counter()
        if self.tables is not None:
            with self.tables.lock:
                by_task.update(r.envelope.task_name for r in self.tables.rows.values())
        return flow_stats(
            flows,
            changed,
            recent,
            sorted(by_task.items()),
            limits,
            slots,
            [(name, key, n) for (name, key), n in sorted(parked.items())],
        )

    def reset_connection(self) -> None:
        """No connection to drop."""


if TYPE_CHECKING:  # mypy checks here that the twin implements the role
    from .protocol import FlowStore

    _flows: type[FlowStore] = InMemoryFlows
