"""Settings of the demo project.

SQLite in ``demo/var`` and kombu's filesystem transport by default; ``DATABASE_URL``
and ``CELERY_BROKER_URL`` switch to a real database and broker.
"""

from __future__ import annotations

import os

from kombu import Exchange, Queue

from demo.config import database_from_url, sqlite_database, var_dir

VAR_DIR = var_dir()

SECRET_KEY = "celery-outbox-demo-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "celery_outbox",
    "celery_outbox.inbox",
    "celery_outbox.handlers",
    "demo.shop",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_database_url = os.environ.get("DATABASE_URL", "")
if _database_url:
    DATABASES = {"default": database_from_url(_database_url)}
else:
    DATABASES = {"default": sqlite_database(VAR_DIR / "demo.sqlite3")}
if DATABASES["default"]["ENGINE"].endswith("mysql"):
    import pymysql  # the mysql extra of celery-outbox

    pymysql.install_as_MySQLdb()

# The broker: a real one when CELERY_BROKER_URL is set, else folders in demo/var.
_broker_url = os.environ.get("CELERY_BROKER_URL", "")
if _broker_url:
    CELERY_BROKER_URL = _broker_url
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
else:
    _broker_dir = VAR_DIR / "broker"
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # Publisher (relay) and consumer (worker) share one folder of messages.
        "data_folder_in": str(_broker_dir / "messages"),
        "data_folder_out": str(_broker_dir / "messages"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": True,
        "processed_folder": str(_broker_dir / "processed"),
        "polling_interval": 0.05,
    }

# One queue per run (the driver sets DEMO_QUEUE), on one shared exchange, so a run
# never sees messages left over by an earlier one. On RabbitMQ the queue removes
# itself a minute after its last use.
DEMO_QUEUE = os.environ.get("DEMO_QUEUE", "celery-outbox-demo")
_exchange = Exchange("celery-outbox-demo", type="direct")
CELERY_TASK_QUEUES = [
    Queue(
        DEMO_QUEUE,
        _exchange,
        routing_key=DEMO_QUEUE,
        queue_arguments={"x-expires": 60_000},
    )
]
CELERY_TASK_DEFAULT_QUEUE = DEMO_QUEUE
CELERY_TASK_DEFAULT_EXCHANGE = _exchange.name
CELERY_TASK_DEFAULT_ROUTING_KEY = DEMO_QUEUE
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# The worker wakes at least every second (heartbeat / 2), so a warm shutdown on
# SIGTERM is quick; only the worker uses this, the relay keeps its own connection.
CELERY_BROKER_HEARTBEAT = 2

# celery-outbox: the app the relay publishes with, a short poll, and no silent
# autocommit writes (every order is placed inside transaction.atomic()).
CELERY_OUTBOX_APP = "demo.celery.app"
CELERY_OUTBOX_POLL_INTERVAL = 0.05
CELERY_OUTBOX_OUTSIDE_TRANSACTION = "raise"

# The demo's events get an exchange of their own on a shared RabbitMQ or Redis (the
# services' queues are named after it; the demo's own test gives each run another).
CELERY_OUTBOX_EVENTS_EXCHANGE = os.environ.get(
    "DEMO_EVENTS_EXCHANGE", "celery-outbox-demo-events"
)

# SQLite is fine here: the demo runs exactly one relay.
SILENCED_SYSTEM_CHECKS = ["celery_outbox.W001"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "celery_outbox": {
            "handlers": ["console"],
            "level": os.environ.get("DEMO_OUTBOX_LOG_LEVEL", "INFO"),
        }
    },
}
