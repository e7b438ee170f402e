"""Settings of the test project.

``OUTBOX_TEST_DB`` picks the default database (postgresql, mysql or sqlite); the other
two are always there as extra aliases so the store contract runs on every vendor.
Hosts and the broker come from environment variables with loopback defaults.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from typing import Any

import pymysql

pymysql.install_as_MySQLdb()

SECRET_KEY = "celery-outbox-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.project.urls"
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_outbox",
    "celery_outbox.inbox",
    "celery_outbox.handlers",
    "tests.project.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# One id per test run, inherited by the relay and worker subprocesses it starts: it
# names the databases and the queue, so concurrent runs never see each other's data.
RUN_ID = os.environ.setdefault("OUTBOX_TEST_RUN", uuid.uuid4().hex[:8])
# OUTBOX_TEST_SERVERS=none (`make check`): every server address below points at a
# port nothing listens on, so a test of that run that reaches for a database or a
# broker fails at once instead of quietly using one that happens to run.
NO_SERVERS = os.environ.get("OUTBOX_TEST_SERVERS") == "none"


def _address(variable: str, default: str, nowhere: str) -> str:
    """A server address of the test project: ``nowhere`` in a run without servers."""
    return nowhere if NO_SERVERS else os.environ.get(variable, default)


_SQLITE_DIR = os.environ.get("OUTBOX_TEST_SQLITE_DIR", tempfile.gettempdir())
POSTGRES = {
    "ENGINE": "tests.project.backends.postgresql",
    "NAME": os.environ.get("OUTBOX_PG_NAME", f"outbox_{RUN_ID}"),
    "USER": os.environ.get("OUTBOX_PG_USER", "postgres"),
    "HOST": _address("OUTBOX_PG_HOST", "127.0.0.1", "127.0.0.1"),
    "PORT": _address("OUTBOX_PG_PORT", "5432", "1"),
    # Lets a fault test find (and kill) one process's backends in pg_stat_activity.
    "OPTIONS": {
        "application_name": os.environ.get(
            "OUTBOX_TEST_APP_NAME", "celery-outbox-tests"
        )
    },
}
MYSQL = {
    "ENGINE": "tests.project.backends.mysql",
    "NAME": os.environ.get("OUTBOX_MYSQL_NAME", f"outbox_{RUN_ID}"),
    "USER": os.environ.get("OUTBOX_MYSQL_USER", "root"),
    "PASSWORD": os.environ.get("OUTBOX_MYSQL_PASSWORD", ""),
    "HOST": _address("OUTBOX_MYSQL_HOST", "127.0.0.1", "127.0.0.1"),
    "PORT": _address("OUTBOX_MYSQL_PORT", "3306", "1"),
    "OPTIONS": {"charset": "utf8mb4"},
}
SQLITE = {
    "ENGINE": "tests.project.backends.sqlite3",
    "NAME": os.path.join(_SQLITE_DIR, f"outbox_{RUN_ID}.sqlite3"),
    "OPTIONS": {"timeout": 30},
    "TEST": {"NAME": os.path.join(_SQLITE_DIR, f"test_outbox_{RUN_ID}.sqlite3")},
}
# PostgreSQL through the write-on-commit engine. Tests reach the PostgreSQL test
# database through it as a mirror (no second database to create and flush), and the
# store contract runs on it too; OUTBOX_TEST_DB=postgresql_commit runs everything on it.
POSTGRES_COMMIT = dict(POSTGRES, ENGINE="celery_outbox.backends.postgresql")
_VENDORS = {
    "postgresql": POSTGRES,
    "mysql": MYSQL,
    "sqlite": SQLITE,
    "postgresql_commit": POSTGRES_COMMIT,
}
DEFAULT_VENDOR = os.environ.get("OUTBOX_TEST_DB", "postgresql")
DATABASES: dict[str, Any] = {"default": _VENDORS[DEFAULT_VENDOR]}
for _vendor, _config in _VENDORS.items():
    if _vendor != DEFAULT_VENDOR:
        DATABASES[_vendor] = _config
_PG_ALIASES = {"postgresql", "postgresql_commit"}
if DEFAULT_VENDOR in _PG_ALIASES:
    _other = (_PG_ALIASES - {DEFAULT_VENDOR}).pop()
    DATABASES[_other] = dict(DATABASES[_other], TEST={"MIRROR": "default"})
else:
    DATABASES["postgresql_commit"]["TEST"] = {"MIRROR": "postgresql"}

# A test run may set OUTBOX_TEST_DB_NAME to reuse the exact database a test created
# (relay and worker subprocesses of the end-to-end tests).
if os.environ.get("OUTBOX_TEST_DB_NAME"):
    DATABASES["default"] = dict(
        DATABASES["default"], NAME=os.environ["OUTBOX_TEST_DB_NAME"]
    )

os.environ.setdefault("OUTBOX_TEST_QUEUE", f"celery-outbox-tests-{RUN_ID}")
# A pytest-xdist worker (gw0, gw1, ...) inherits the run's id from the controller, and
# pytest-django gives it test databases of its own (the worker's name added to each):
# it takes a queue of its own too, and its relay and worker subprocesses inherit it.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if XDIST_WORKER and os.environ["OUTBOX_TEST_QUEUE"] == f"celery-outbox-tests-{RUN_ID}":
    os.environ["OUTBOX_TEST_QUEUE"] = f"celery-outbox-tests-{RUN_ID}-{XDIST_WORKER}"
CELERY_BROKER_URL = _address(
    "OUTBOX_TEST_BROKER",
    "amqp://guest:guest@127.0.0.1:5672//",
    "amqp://guest:guest@127.0.0.1:1//",
)
CELERY_RESULT_BACKEND = _address(
    "OUTBOX_TEST_RESULT_BACKEND", "redis://127.0.0.1:6379/15", "redis://127.0.0.1:1/15"
)
CELERY_TASK_DEFAULT_QUEUE = os.environ["OUTBOX_TEST_QUEUE"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# The end-to-end tests' workers set a short AMQP heartbeat: the worker's event loop
# then wakes every few seconds and notices SIGTERM at once instead of after ~10 s.
if os.environ.get("OUTBOX_TEST_BROKER_HEARTBEAT"):
    CELERY_BROKER_HEARTBEAT = float(os.environ["OUTBOX_TEST_BROKER_HEARTBEAT"])

# The scheduled-task tests: a Redis visibility timeout shorter than their countdowns
# (kombu then looks for unacknowledged messages to restore every second), and the threshold
# beyond which an ETA waits in the outbox.
if os.environ.get("OUTBOX_TEST_VISIBILITY_TIMEOUT"):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": float(os.environ["OUTBOX_TEST_VISIBILITY_TIMEOUT"]),
        "unacked_restore_throttle": 1,
        "unacked_restore_interval": 1,  # kombu >= 5.7; every 10 s before
    }
if os.environ.get("OUTBOX_TEST_SCHEDULE_AFTER"):
    CELERY_OUTBOX_SCHEDULE_AFTER = float(os.environ["OUTBOX_TEST_SCHEDULE_AFTER"])
# Flow control's e2e test: CELERY_OUTBOX_FLOWS as JSON, for the relays and the worker.
if os.environ.get("OUTBOX_TEST_FLOWS"):
    CELERY_OUTBOX_FLOWS = json.loads(os.environ["OUTBOX_TEST_FLOWS"])

SILENCED_SYSTEM_CHECKS = ["celery_outbox.W001"]

# The app the relay, the commands and the plugin's run_enqueued use, named as the docs
# advise: "the only OutboxCelery in the process" depends on what else a test process
# has created and still holds (tests of event services make apps of their own), so
# it would depend on which tests ran before in the same process (pytest-xdist).
# The tests of that lookup set this to None themselves.
CELERY_OUTBOX_APP = "tests.project.celery_app.app"
CELERY_OUTBOX_POLL_INTERVAL = 0.2
CELERY_OUTBOX_LEASE_SECONDS = 30.0
#: A strict head killed with its worker goes out again after this (the e2e tests'
#: kill -9 waits it out).
CELERY_OUTBOX_STRICT_LEASE_SECONDS = float(
    os.environ.get("OUTBOX_TEST_STRICT_LEASE", "300")
)
CELERY_OUTBOX_OUTSIDE_TRANSACTION = "warn"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"celery_outbox": {"handlers": ["console"], "level": "INFO"}},
}
