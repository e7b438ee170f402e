"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

BROKER_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
BROKER_REDIS = "redis://127.0.0.1:6379/14"


@pytest.fixture(scope="session")
def test_queue() -> str:
    """The default queue of this test run (also used by relay/worker subprocesses)."""
    return os.environ["OUTBOX_TEST_QUEUE"]


@pytest.fixture(scope="session")
def outbox_app() -> Any:
    """The test project's OutboxCelery app."""
    from tests.project.celery_app import app

    return app


@pytest.fixture(scope="session", autouse=True)
def _delete_test_queue(test_queue: str) -> Iterator[None]:
    yield
    from kombu import Connection

    with Connection(BROKER_AMQP, connect_timeout=5) as conn:
        channel = conn.channel()
        try:
            channel.queue_delete(test_queue)
        finally:
            channel.close()
