"""Django settings of the settle part (``bench.settle``): one database of its own.

``OUTBOX_BENCH_SETTLE_VENDOR`` picks it: ``postgresql``, ``mysql`` (MariaDB) or
``sqlite``. The part empties the outbox tables between sizes, so it never uses the
bench's shared ``outbox_bench``: its database is ``outbox_bench_settle``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pymysql

from bench import env
from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)

pymysql.install_as_MySQLdb()

VENDOR = os.environ.get("OUTBOX_BENCH_SETTLE_VENDOR", "postgresql")
NAME = "outbox_bench_settle"
_DATABASES: dict[str, dict[str, Any]] = {
    "postgresql": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": NAME,
        "USER": env.PG_USER,
        "HOST": env.PG_HOST,
        "PORT": env.PG_PORT,
    },
    "mysql": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": NAME,
        "USER": os.environ.get("OUTBOX_BENCH_MYSQL_USER", "root"),
        "PASSWORD": os.environ.get("OUTBOX_BENCH_MYSQL_PASSWORD", ""),
        "HOST": os.environ.get("OUTBOX_BENCH_MYSQL_HOST", "127.0.0.1"),
        "PORT": os.environ.get("OUTBOX_BENCH_MYSQL_PORT", "3306"),
        "OPTIONS": {"charset": "utf8mb4"},
    },
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(tempfile.gettempdir(), f"{NAME}.sqlite3"),
    },
}
DATABASES = {"default": _DATABASES[VENDOR]}
DATABASE_ROUTERS = []
INSTALLED_APPS = ["celery_outbox"]
CELERY_OUTBOX_HISTORY = True
