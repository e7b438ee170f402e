"""Django settings of the inbox part (``bench.inbox``): the bench's, plus the inbox.

``OUTBOX_BENCH_INBOX_VENDOR`` picks the one database: ``postgresql`` (the bench's
``outbox_bench``) or ``mysql`` (MariaDB, a database of the same name).
"""

from __future__ import annotations

import os
from typing import Any

import pymysql

from bench import env
from bench.settings import *  # noqa: F403  (the bench's settings, then what differs)
from bench.settings import DATABASES as _BENCH_DATABASES
from bench.settings import INSTALLED_APPS as _BENCH_APPS

pymysql.install_as_MySQLdb()

VENDOR = os.environ.get("OUTBOX_BENCH_INBOX_VENDOR", "postgresql")
MYSQL_NAME = os.environ.get("OUTBOX_BENCH_MYSQL_DB", env.PG_NAME)
MYSQL: dict[str, Any] = {
    "ENGINE": "django.db.backends.mysql",
    "NAME": MYSQL_NAME,
    "USER": os.environ.get("OUTBOX_BENCH_MYSQL_USER", "root"),
    "PASSWORD": os.environ.get("OUTBOX_BENCH_MYSQL_PASSWORD", ""),
    "HOST": os.environ.get("OUTBOX_BENCH_MYSQL_HOST", "127.0.0.1"),
    "PORT": os.environ.get("OUTBOX_BENCH_MYSQL_PORT", "3306"),
    "OPTIONS": {"charset": "utf8mb4"},
    "CONN_MAX_AGE": None,
}

INSTALLED_APPS = [*_BENCH_APPS, "celery_outbox.inbox"]
DATABASES = {"default": MYSQL if VENDOR == "mysql" else _BENCH_DATABASES["default"]}
# One alias, so no router: the enqueue part's switch between aliases is not needed.
DATABASE_ROUTERS = []
