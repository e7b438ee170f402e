"""The test project's settings, with the events exchange and retries of one test run."""

from __future__ import annotations

import os

from tests.project.settings import *  # noqa: F403

CELERY_OUTBOX_APP = "tests.events_project.shop.app"
CELERY_OUTBOX_EVENTS_EXCHANGE = os.environ.get("OUTBOX_TEST_EVENTS_EXCHANGE", "events")
CELERY_OUTBOX_EVENTS_MAX_RETRIES = int(
    os.environ.get("OUTBOX_TEST_EVENTS_RETRIES", "3")
)
