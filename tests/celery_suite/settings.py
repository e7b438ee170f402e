"""Django settings of the outbox run of Celery's integration suite.

A PostgreSQL database of its own (``OUTBOX_SUITE_DB``, created and dropped by the
run), so the relay is woken by NOTIFY like a production one; Celery's tests call
tasks outside any transaction, which the outbox then writes on their own.
"""

from __future__ import annotations

import os

SECRET_KEY = "celery-outbox-celery-suite"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django.contrib.contenttypes", "celery_outbox"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("OUTBOX_SUITE_DB", "outbox_celery_suite"),
        "USER": os.environ.get("OUTBOX_PG_USER", "postgres"),
        "HOST": os.environ.get("OUTBOX_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("OUTBOX_PG_PORT", "5432"),
    }
}
CELERY_OUTBOX_OUTSIDE_TRANSACTION = "allow"
CELERY_OUTBOX_POLL_INTERVAL = 0.2
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"celery_outbox": {"handlers": ["console"], "level": "WARNING"}},
}
