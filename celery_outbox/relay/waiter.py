"""Deprecated: :class:`Waiter` lives in :mod:`celery_outbox.engine.waiter`."""

from __future__ import annotations

from ..deprecation import deprecated
from ..engine.waiter import Waiter

deprecated("celery_outbox.relay.waiter", "celery_outbox.engine.waiter (Waiter)")

__all__ = ["Waiter"]
