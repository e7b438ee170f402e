"""An in-memory twin of :class:`~.flows.FlowQueries`: flow control without a database.

The same rules -- a decision per flow at a time, records written before the
publish, records past the longest window dropped -- on an injected clock, so a
test moves through windows without sleeping. Given the in-memory outbox's
:class:`~.memory.Tables`, its stats count the rows waiting there.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..flow.core import (
    Flow,
    FlowStats,
    Grant,
    Rate,
    grant,
    rates_in_force,
    rates_text,
    use_of,
)
from .flows import MINUTE, flow_stats
from .memory import Tables


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

    def reserve(self, flow: Flow, wanted: int) -> Grant:
        """Grant up to ``wanted`` publishes of ``flow`` now, and record them."""
        with self._lock:
            now = self.clock()
            rates = rates_in_force(flow, self.changed.get(flow.name))
            records = self.records.setdefault(flow.name, [])
            uses = [use_of(records, rate, now) for rate in rates]
            paced_for = self.paced_until.get(flow.name, now) - now
            granted = grant(uses, wanted, paced_for)
            if granted.held:
                self.paced_until[flow.name] = now + granted.paced_for
            if granted.granted:
                records.append((now, granted.granted))
            longest = max(r.seconds for r in (*rates, *flow.rates))
            records[:] = [(at, n) for at, n in records if at > now - longest]
        return granted

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
        by_task: Counter[str] = Counter()
        if self.tables is not None:
            with self.tables.lock:
                by_task.update(r.envelope.task_name for r in self.tables.rows.values())
        return flow_stats(flows, changed, recent, sorted(by_task.items()))

    def reset_connection(self) -> None:
        """No connection to drop."""


if TYPE_CHECKING:  # mypy checks here that the twin implements the role
    from .protocol import FlowStore

    _flows: type[FlowStore] = InMemoryFlows
