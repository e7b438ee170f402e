"""Fixtures shared by every test layer, and which tests need a server.

A test under ``tests/integration``, ``tests/e2e``, ``tests/faults`` or ``tests/plugin``
(or marked ``@pytest.mark.servers``, or using Django's test database) needs
PostgreSQL, MariaDB, RabbitMQ and Redis; every other test needs none
(``tests/servers.py``), and ``tests/unit`` must hold no other kind. ``OUTBOX_TEST_SERVERS=none``
(``make check``) leaves the first kind out. Otherwise the servers are probed once
before the first such test: in CI (``CI=true``) a missing one fails the run, elsewhere
the tests that need it are skipped with a reason that names it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import servers

#: The brokers of the end-to-end tests (nowhere in a run without servers, as the
#: test project's own addresses).
BROKER_AMQP = (
    "amqp://guest:guest@127.0.0.1:1//"
    if servers.without_servers()
    else "amqp://guest:guest@127.0.0.1:5672//"
)
BROKER_REDIS = (
    "redis://127.0.0.1:1/14"
    if servers.without_servers()
    else "redis://127.0.0.1:6379/14"
)


def pytest_report_header(config: pytest.Config) -> str:
    if servers.without_servers():
        return (
            "OUTBOX_TEST_SERVERS=none: the tests that need a server are left out, and "
            "every server address points at 127.0.0.1:1 (nothing listens there)"
        )
    return "servers: PostgreSQL, MariaDB, RabbitMQ, Redis (tests/servers.py)"


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks set here
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    needing = [
        item
        for item in items
        if servers.needs_servers(
            item.path,
            (mark.name for mark in item.iter_markers()),
            getattr(item, "fixturenames", ()),
        )
    ]
    for item in needing:
        item.add_marker(pytest.mark.servers)
    for item in items:
        if servers.folder_of(item.path) in servers.SERIAL_FOLDERS:
            item.add_marker(pytest.mark.serial)
    if not needing:
        return
    if servers.without_servers():
        _refuse_unit_tests_that_need_servers(needing)
        chosen = set(needing)
        config.hook.pytest_deselected(items=needing)
        items[:] = [item for item in items if item not in chosen]
        return
    _require_servers(needing)


def _refuse_unit_tests_that_need_servers(needing: list[pytest.Item]) -> None:
    misplaced = [
        item.nodeid
        for item in needing
        if servers.folder_of(item.path) == servers.NO_SERVER_FOLDER
    ]
    if misplaced:
        raise pytest.UsageError(
            f"tests/{servers.NO_SERVER_FOLDER} is for tests that need no server, but "
            "these use Django's test database or are marked servers; move them to "
            "tests/integration:\n  " + "\n  ".join(misplaced)
        )


def _require_servers(needing: list[pytest.Item]) -> None:
    from django.conf import settings

    found = servers.servers_of(settings, (BROKER_AMQP, BROKER_REDIS))
    problems = servers.missing(found)
    if not problems:
        return
    if servers.in_ci():
        raise pytest.UsageError(
            f"{len(needing)} collected test(s) need servers that are not there "
            "(CI=true: a missing server fails the run, it never skips):\n  "
            + "\n  ".join(problems)
            + "\nStart them with `make services`."
        )
    skip = pytest.mark.skip(reason=f"{'; '.join(problems)}: {servers.HOW_TO_START}")
    for item in needing:
        item.add_marker(skip)


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
def _delete_test_queue(
    request: pytest.FixtureRequest, test_queue: str
) -> Iterator[None]:
    """Remove this run's RabbitMQ queue, when tests that use the servers ran."""
    yield
    ran_servers = any(
        item.get_closest_marker("servers") and not item.get_closest_marker("skip")
        for item in request.session.items
    )
    if not ran_servers:
        return
    from kombu import Connection

    with Connection(BROKER_AMQP, connect_timeout=5) as conn:
        channel = conn.channel()
        try:
            channel.queue_delete(test_queue)
        finally:
            channel.close()


# -- what a stage of `make test` ran (scripts/stages.py) ---------------------------

#: Under scripts/stages.py (``OUTBOX_STAGE`` set), the run writes how many tests it
#: ran, by outcome, and its slowest ones, for the stage table at the end of make test.
#: Taken out of the environment: a pytest this run starts (the plugin's and the fast
#: lane's own tests run pytest in subprocesses) is no stage's and writes nothing.
_STAGE = os.environ.pop("OUTBOX_STAGE", None)
#: How many of a run's slowest tests it writes (the report keeps ten of all runs).
_SLOWEST_KEPT = 25
_durations: dict[str, float] = {}
_outcomes: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _STAGE is None:
        return
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
    elif report.outcome == "failed":
        outcome = "error"
    elif report.outcome == "skipped":
        outcome = "skipped"
    else:
        return
    _outcomes[outcome] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Under pytest-xdist the controller sees every report: its workers write nothing.
    if _STAGE is None or hasattr(session.config, "workerinput"):
        return
    from scripts.stages import file_name, stages_dir

    slowest = sorted(_durations.items(), key=lambda item: -item[1])[:_SLOWEST_KEPT]
    files: Counter[str] = Counter()
    for nodeid, seconds in _durations.items():
        files[nodeid.split("::", 1)[0]] += seconds
    folder = stages_dir()
    folder.mkdir(parents=True, exist_ok=True)
    name = file_name(f"tests {_STAGE} {os.getpid()}")
    Path(folder / name).write_text(
        json.dumps(
            {
                "stage": _STAGE,
                "tests": dict(_outcomes),
                "slowest": [[nodeid, round(s, 2)] for nodeid, s in slowest],
                "files": {path: round(s, 2) for path, s in sorted(files.items())},
            }
        )
    )
