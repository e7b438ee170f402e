"""The handler outboxes' store: its role, on a database and in memory.

* :class:`HandlerLeases` (:mod:`.protocol`): what the processor asks;
* :class:`~.sql.HandlerStore` (:mod:`.sql`): every read and write of the handler
  tables on one database alias, with the operators' queries (stats, replay, pauses),
  and :class:`~.sql.HandlerMembers`, processor heartbeats over every database;
* :class:`MemoryHandlerStore` (:mod:`.memory`): the in-memory twin.

:mod:`.sql` is imported from its own path: it needs the handler models, which
Django loads after this package (the handler app imports the values from here).
"""

from __future__ import annotations

from .memory import HandlerTables, MemoryHandlerStore
from .protocol import HandlerLeases
from .types import (
    ERROR_LIMIT,
    KEY_LENGTH,
    BlockedShard,
    HandlerLeftover,
    HandlerStats,
    Lease,
    LeaseLost,
    Pauses,
    ReplayReport,
    Row,
    ShardDepth,
    StatementRefused,
)

__all__ = [
    "ERROR_LIMIT",
    "KEY_LENGTH",
    "BlockedShard",
    "HandlerLeases",
    "HandlerLeftover",
    "HandlerStats",
    "HandlerTables",
    "Lease",
    "LeaseLost",
    "MemoryHandlerStore",
    "Pauses",
    "ReplayReport",
    "Row",
    "ShardDepth",
    "StatementRefused",
]
