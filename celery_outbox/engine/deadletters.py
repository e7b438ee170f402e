"""Dead-letter retention, the same rule for every lane.

A lane's store deletes its dead letters older than a number of seconds
(``purge_dead_letters(older_than)``); :func:`expire` applies the configured
retention to it: None keeps every dead letter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("celery_outbox")


def expire(
    purge: Callable[[float], int],
    retention: float | None,
    what: str = "dead letters",
    log: logging.Logger = logger,
) -> int:
    """Delete ``what`` older than ``retention`` seconds through ``purge``; how many."""
    if retention is None:
        return 0
    deleted = purge(retention)
    if deleted:
        log.info("purged %d %s older than %.0f s", deleted, what, retention)
    return deleted
