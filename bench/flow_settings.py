"""Django settings of the flow part (``bench.flow``): the bench's PostgreSQL database,
one flow of 20/s over ``bench.flowed``; ``bench.limited`` (stock Celery's
``rate_limit``) goes straight to the broker. The part's own process, its two relays
and its two workers all read these settings."""

from __future__ import annotations

from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)
from bench.settings import DATABASES as _BENCH_DATABASES

#: The rate of the flow and of the control, per second.
RATE = 20

DATABASES = {"default": _BENCH_DATABASES["default"]}
DATABASE_ROUTERS: list[str] = []
CELERY_OUTBOX_FLOWS = {"bench": {"tasks": ["bench.flowed"], "rate": f"{RATE}/s"}}
CELERY_OUTBOX_EXCLUDE_TASKS = ["bench.limited"]
