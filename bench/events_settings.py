"""Django settings of the events part's relay and workers (``bench.events_e2e``).

The bench's settings, plus the events exchange and the retries of one run, read from
the environment the driver sets: ``OUTBOX_BENCH_EVENTS_EXCHANGE`` and
``OUTBOX_BENCH_EVENTS_RETRIES`` (``broker`` or ``database``). Retry steps are 1, 2
and 4 s.
"""

from __future__ import annotations

import os

from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)

CELERY_OUTBOX_EVENTS_EXCHANGE = os.environ.get("OUTBOX_BENCH_EVENTS_EXCHANGE", "events")
CELERY_OUTBOX_EVENTS_RETRIES = os.environ.get("OUTBOX_BENCH_EVENTS_RETRIES", "auto")
CELERY_OUTBOX_EVENTS_MAX_RETRIES = 3
# The workers' AMQP heartbeat: their event loop wakes every half of it, so a worker
# acts on SIGTERM within a second instead of up to ten.
if os.environ.get("OUTBOX_BENCH_BROKER_HEARTBEAT"):
    CELERY_BROKER_HEARTBEAT = float(os.environ["OUTBOX_BENCH_BROKER_HEARTBEAT"])

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "celery_outbox": {"handlers": ["console"], "level": "WARNING"},
        # A worker says which queues it consumes: the driver waits for that line.
        "celery_outbox.events": {"level": "INFO"},
    },
}
