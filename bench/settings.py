"""Django settings of the benchmark: PostgreSQL ``outbox_bench``, a queue per run."""

from __future__ import annotations

from kombu import Exchange, Queue

from bench import env

SECRET_KEY = "celery-outbox-bench-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
#: The handler outboxes for part 11 (bench.handlers_latency).
INSTALLED_APPS = ["celery_outbox", "celery_outbox.handlers", "bench"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": env.PG_NAME,
        "USER": env.PG_USER,
        "HOST": env.PG_HOST,
        "PORT": env.PG_PORT,
        "CONN_MAX_AGE": None,
    }
}
#: The same database through the write-on-commit engine: the outbox row travels in
#: the COMMIT's round trip (the enqueue part measures both).
DATABASES["commit"] = dict(
    DATABASES["default"], ENGINE="celery_outbox.backends.postgresql"
)

_exchange = Exchange(env.QUEUE, type="direct")
CELERY_BROKER_URL = env.broker_url()
CELERY_TASK_QUEUES = [
    # No x-expires: kombu re-declares an expiring queue before every publish, which
    # is not what a typical deployment does (the run deletes its queue at the end).
    Queue(env.QUEUE, _exchange, routing_key=env.QUEUE)
]
CELERY_TASK_DEFAULT_QUEUE = env.QUEUE
CELERY_TASK_DEFAULT_EXCHANGE = env.QUEUE
CELERY_TASK_DEFAULT_ROUTING_KEY = env.QUEUE
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

#: The outbox alias is the router's (bench.routing), so that the enqueue part can
#: switch it between rounds without changing a setting.
DATABASE_ROUTERS = ["bench.routing.OutboxRouter"]

CELERY_OUTBOX_APP = "bench.celery.app"
CELERY_OUTBOX_OUTSIDE_TRANSACTION = "raise"
CELERY_OUTBOX_BATCH_SIZE = 500
CELERY_OUTBOX_POLL_INTERVAL = 1.0
CELERY_OUTBOX_NOTIFY = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # One line per batch would cost time and bury the table: warnings only.
    "loggers": {"celery_outbox": {"handlers": ["console"], "level": "WARNING"}},
}
