"""Deprecated: the heartbeat lives in :mod:`celery_outbox.engine.heartbeat`."""

from __future__ import annotations

from ..deprecation import deprecated
from ..engine.heartbeat import STALE_BEATS, Heartbeat, new_relay_id

deprecated(
    "celery_outbox.relay.heartbeat",
    "celery_outbox.engine.heartbeat (Heartbeat, STALE_BEATS, new_member_id)",
)

__all__ = ["STALE_BEATS", "Heartbeat", "new_relay_id"]
