"""All outbox SQL lives in this package: the relay, commands and admin use :class:`OutboxStore`."""

from __future__ import annotations

from .store import OutboxStore
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
    "OutboxStore",
    "PurgeReport",
    "ReplayReport",
    "RetryingTask",
    "SettleReport",
    "Stats",
    "Summary",
    "TopFailures",
]
