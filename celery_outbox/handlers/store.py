"""Deprecated: the handler store lives in :mod:`celery_outbox.store.handlers`."""

from __future__ import annotations

from ..deprecation import deprecated
from ..store.handlers import (
    ERROR_LIMIT,
    BlockedShard,
    HandlerStats,
    Lease,
    LeaseLost,
    Pauses,
    ReplayReport,
    ShardDepth,
)
from ..store.handlers.sql import HandlerMembers, HandlerStore

deprecated("celery_outbox.handlers.store", "celery_outbox.store.handlers")

__all__ = [
    "ERROR_LIMIT",
    "BlockedShard",
    "HandlerMembers",
    "HandlerStats",
    "HandlerStore",
    "Lease",
    "LeaseLost",
    "Pauses",
    "ReplayReport",
    "ShardDepth",
]
