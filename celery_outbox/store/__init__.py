"""All outbox SQL lives in this package: the relay, commands and admin use :class:`OutboxStore`."""

from __future__ import annotations

from .store import Claim, OutboxStore, SettleReport, Stats

__all__ = ["Claim", "OutboxStore", "SettleReport", "Stats"]
