"""The fault suite: real relay and worker processes while the things around them fail.

It reuses the end-to-end fixtures. Each test records what it measured; the figures
are printed in one table at the end of the run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import e2e, pytest_runtest_makereport

__all__ = ["e2e", "pytest_runtest_makereport"]

MEASUREMENTS: list[str] = []


@pytest.fixture
def measured() -> Iterator[list[str]]:
    """Lines of figures a fault test reports (lost, duplicates, dead letters, recovery)."""
    lines: list[str] = []
    yield lines
    MEASUREMENTS.extend(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MEASUREMENTS:
        terminalreporter.section("fault suite measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
