"""All outbox SQL lives in this package, split by role (:mod:`.protocol`).

:func:`outbox_stores` (or :class:`Stores` on an explicit alias) builds the role
object a consumer needs: the relay's claims, the enqueue's writes, the operator's
queries, ordered keys' heads, history, relay heartbeats, ``dedup_key`` holds.
"""

from __future__ import annotations

from .protocol import (
    DedupStore,
    EnqueueStore,
    EventStore,
    FlowStore,
    HistoryStore,
    OperatorStore,
    OrderingStore,
    RegistryStore,
    RelayStore,
)
from .roles import Stores, outbox_alias, outbox_stores
from .types import (
    BacklogGroup,
    Claim,
    DeadLetterFilter,
    DeadTask,
    PurgeReport,
    ReplayReport,
    RetryingTask,
    SettleReport,
    Stats,
    Summary,
    TopFailures,
)

__all__ = [
    "BacklogGroup",
    "Claim",
    "DeadLetterFilter",
    "DeadTask",
    "DedupStore",
    "EnqueueStore",
    "EventStore",
    "FlowStore",
    "HistoryStore",
    "OperatorStore",
    "OrderingStore",
    "PurgeReport",
    "RegistryStore",
    "RelayStore",
    "ReplayReport",
    "RetryingTask",
    "SettleReport",
    "Stats",
    "Stores",
    "Summary",
    "TopFailures",
    "outbox_alias",
    "outbox_stores",
]
