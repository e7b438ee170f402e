"""Django settings of a relay in the history part (``bench.history``): the bench's, history on."""

from __future__ import annotations

from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)

CELERY_OUTBOX_HISTORY = True
