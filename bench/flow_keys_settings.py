"""Django settings of the flow keys' parts (``bench.flow_keys``): the bench's
PostgreSQL database and two flows with limits per key, ``cap`` over
``bench.capped`` (at most 2 of a key running) and ``fair`` over ``bench.fair`` (at
most ``OUTBOX_BENCH_FAIR_QUEUED`` of a key queued, 8 unless set). ``bench.ordered``,
called with the same ``flow_key=``, is in no flow: the control. The part's own
process, its relay and its workers all read these settings."""

from __future__ import annotations

import os

from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)
from bench.settings import DATABASES as _BENCH_DATABASES

#: Tasks of one key published and not finished, at most (flow ``cap``).
RUNNING = 2
#: Tasks of one key published and not started, at most (flow ``fair``).
QUEUED = int(os.environ.get("OUTBOX_BENCH_FAIR_QUEUED", "8"))

DATABASES = {"default": _BENCH_DATABASES["default"]}
DATABASE_ROUTERS = []
CELERY_OUTBOX_FLOWS = {
    "cap": {"tasks": ["bench.capped"], "running": RUNNING},
    "fair": {"tasks": ["bench.fair"], "queued": QUEUED},
}
