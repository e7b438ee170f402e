"""Deprecated: the handler store lives in :mod:`celery_outbox.store.handlers`."""

from __future__ import annotations

import warnings

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

warnings.warn(
    "celery_outbox.handlers.store is deprecated and goes in the next release: "
    "import from celery_outbox.store.handlers.",
    DeprecationWarning,
    stacklevel=2,
)

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
