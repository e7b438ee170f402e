"""Deprecated: :class:`Waiter` lives in :mod:`celery_outbox.engine.waiter`."""

from __future__ import annotations

import warnings

from ..engine.waiter import Waiter

warnings.warn(
    "celery_outbox.relay.waiter is deprecated and goes in the next release: "
    "import Waiter from celery_outbox.engine.waiter.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Waiter"]
