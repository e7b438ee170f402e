"""Django settings of the strict ordering part (``bench.strict``): one database.

``OUTBOX_BENCH_STRICT_VENDOR`` picks it: ``postgresql`` (the bench's ``outbox_bench``,
LISTEN/NOTIFY on) or ``mysql`` (MariaDB, a database of the same name, where the relay
polls). The part's own process, its relay and its workers all read these settings.
"""

from __future__ import annotations

import os

from bench.inbox_settings import MYSQL
from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)
from bench.settings import DATABASES as _BENCH_DATABASES

VENDOR = os.environ.get("OUTBOX_BENCH_STRICT_VENDOR", "postgresql")
DATABASES = {"default": MYSQL if VENDOR == "mysql" else _BENCH_DATABASES["default"]}
# One alias, so no router: the enqueue part's switch between aliases is not needed.
DATABASE_ROUTERS: list[str] = []
