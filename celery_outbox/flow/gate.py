"""The flow gate: a claimed batch's rows of each flow, as many as its rates allow.

Rows of no flow go through without a query. For each flow with rows in the batch,
one reservation (:meth:`~celery_outbox.store.protocol.FlowStore.reserve`) decides
and records how many may go; :func:`~.core.plan` picks them and paces the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..conf import OutboxSettings
from ..engine.gate import OPEN, Gate
from ..envelope import StoredMessage
from ..store.protocol import FlowStore
from .core import Admission, Flow, flow_of, plan


class FlowGate:
    """Applies ``flows`` on the state ``store`` keeps (the same for every relay)."""

    def __init__(self, flows: Sequence[Flow], store: FlowStore) -> None:
        self.flows = tuple(flows)
        self.store = store
        self._by_name = {flow.name: flow for flow in self.flows}

    def flow_name(self, task_name: str) -> str | None:
        """The name of the flow that covers ``task_name``; None when none does."""
        found = flow_of(self.flows, task_name)
        return None if found is None else found.name

    def admit(self, messages: Sequence[StoredMessage]) -> Admission:
        """The rows the flows let through now; the rest released, paced."""
        wanted = Counter(
            name
            for name in (self.flow_name(m.envelope.task_name) for m in messages)
            if name is not None
        )
        if not wanted:
            return Admission(tuple(messages))
        # One transaction per flow, in name order, each short: no relay holds one
        # flow's lock while it waits for another's.
        grants = {
            name: self.store.reserve(self._by_name[name], count)
            for name, count in sorted(wanted.items())
        }
        return plan(messages, self.flow_name, grants)


def gate_for(settings: OutboxSettings, store: FlowStore) -> Gate:
    """The flow gate when flows are configured; else the open gate (no query)."""
    if not settings.flows:
        return OPEN
    return FlowGate(settings.flows, store)
