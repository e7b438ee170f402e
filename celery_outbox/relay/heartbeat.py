"""Deprecated: the heartbeat lives in :mod:`celery_outbox.engine.heartbeat`."""

from __future__ import annotations

import warnings

from ..engine.heartbeat import STALE_BEATS, Heartbeat, new_relay_id

warnings.warn(
    "celery_outbox.relay.heartbeat is deprecated and goes in the next release: "
    "import Heartbeat, STALE_BEATS and new_member_id from "
    "celery_outbox.engine.heartbeat.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["STALE_BEATS", "Heartbeat", "new_relay_id"]
