"""The fault suite: real relay and worker processes while the things around them fail.

It reuses the end-to-end fixtures. Each test records what it measured; the figures
are printed in one table at the end of the run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kombu import Connection

from tests.e2e.conftest import BROKER_AMQP, e2e, pytest_runtest_makereport

__all__ = ["e2e", "pytest_runtest_makereport"]

MEASUREMENTS: list[str] = []


@pytest.fixture
def measured() -> Iterator[list[str]]:
    """Lines of figures a fault test reports (lost, duplicates, dead letters, recovery)."""
    lines: list[str] = []
    yield lines
    MEASUREMENTS.extend(lines)


@pytest.fixture
def rabbit_queue(test_queue: str) -> Iterator[str]:
    """This run's RabbitMQ queue, purged before and after the test."""
    purge(test_queue)
    yield test_queue
    purge(test_queue)


def purge(queue: str) -> None:
    """Declare ``queue`` (durable) and drop every message in it."""
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        try:
            channel.queue_declare(queue, durable=True, auto_delete=False)
            channel.queue_purge(queue)
        finally:
            channel.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MEASUREMENTS:
        terminalreporter.section("fault suite measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
