"""The wake-up hint a write carries on PostgreSQL, and when to leave it out.

The enqueue path adds ``pg_notify`` to its INSERT (delivered only if the transaction
commits); the relay's listener (:mod:`celery_outbox.relay.listener`) wakes up at
once. Never needed for correctness: polling stays underneath as the safety net.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ..caches import on_reset

CHANNEL = "celery_outbox"

#: A write leaves the hint out when a transaction of the same process committed one
#: less than this many seconds ago: the relay it woke is still draining, then polls
#: every few milliseconds.
COALESCE_SECONDS = 0.02


class HintCoalescer:
    """Whether the rows about to be written should carry the wake-up hint.

    A burst of commits should not become a burst of notifications (every ``NOTIFY``
    takes a lock at commit). Only a hint that was committed counts: one whose
    transaction rolled back woke nobody and silences nothing.
    """

    def __init__(
        self,
        seconds: float = COALESCE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._seconds = seconds
        self._clock = clock
        self._committed_at = -math.inf

    def due(self) -> bool:
        """Whether no hint has been committed within the window."""
        return self._clock() - self._committed_at >= self._seconds

    def committed(self) -> None:
        """A transaction that carried the hint has committed."""
        self._committed_at = self._clock()

    def forget(self) -> None:
        """Start over (a forked child: the parent's hints woke the parent's relay)."""
        self._committed_at = -math.inf


#: The process's coalescer, shared by every connection and thread.
HINTS = HintCoalescer()
on_reset(HINTS.forget)


def remember_hint(connection: Any) -> None:
    """Count a hint just written on ``connection`` once its transaction commits."""
    if connection.in_atomic_block:
        connection.on_commit(HINTS.committed)
    elif connection.get_autocommit():
        HINTS.committed()
    # A transaction managed by hand: its commit cannot be followed, so the next write
    # carries the hint again.
