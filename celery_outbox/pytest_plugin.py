"""pytest fixtures for code that sends tasks through the outbox.

Loaded automatically through the ``pytest11`` entry point. pytest loads plugins
before Django is configured, so this module imports nothing from Django or from the
outbox models: the fixtures import :mod:`celery_outbox.testing` when a test uses
them. Test suites that never use the fixtures are not affected; a test that uses one
without a ``django_db`` mark is given a plain one, so pytest-django creates the test
database for it.

* ``outbox`` — an :class:`~celery_outbox.testing.OutboxFixture`: ``messages``,
  ``task_names()``, ``assert_enqueued()``, ``assert_not_enqueued()``, ``clear()``,
  ``drain()``, ``run_enqueued()``.
* ``outbox_broker`` — the in-memory broker ``outbox.drain()`` publishes to.
* ``outbox_drain`` — ``outbox.drain``, for tests that only drain.
* ``outbox_run`` — ``outbox.run_enqueued``, for tests that only run what was sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .broker import InMemoryPublisher
    from .envelope import Envelope
    from .testing import ExecutedTask, OutboxFixture


#: The fixtures that use the database.
FIXTURES = frozenset({"outbox", "outbox_broker", "outbox_drain", "outbox_run"})


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Mark unmarked tests that use an outbox fixture ``django_db``.

    pytest-django sets up the test databases for the tests that carry the mark or
    name ``db`` in their signature; the fixtures ask for ``db`` only as they run, too
    late to count. Without the mark, a run of only such tests would not create the
    test database and would reach the real one named in settings.
    """
    if not config.pluginmanager.hasplugin("django"):
        return  # the fixtures themselves say that pytest-django is missing
    unmarked = [
        item
        for item in items
        if FIXTURES.intersection(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("django_db") is None
    ]
    if not unmarked:
        return
    from django.conf import settings

    if not settings.configured:
        return  # pytest-django would skip the test; the fixture says what is missing
    for item in unmarked:
        item.add_marker(pytest.mark.django_db)


def _database_access(request: pytest.FixtureRequest) -> None:
    """Make sure Django is set up and the test may use the database."""
    if not request.config.pluginmanager.hasplugin("django"):
        pytest.fail(
            "celery-outbox's outbox fixtures need pytest-django (pip install "
            "pytest-django) and DJANGO_SETTINGS_MODULE pointing at your settings.",
            pytrace=False,
        )
    from django.conf import settings

    if not settings.configured:
        pytest.fail(
            "celery-outbox's outbox fixtures need Django settings: set "
            "DJANGO_SETTINGS_MODULE (or --ds) for pytest-django.",
            pytrace=False,
        )
    # pytest-django's ``db`` honours the test's django_db mark (transaction=True,
    # databases=...) and ``transactional_db``; without either it gives TestCase-style
    # access, so a test may use ``outbox`` without marking itself.
    request.getfixturevalue("db")


@pytest.fixture
def outbox(request: pytest.FixtureRequest) -> OutboxFixture:
    """The outbox of the configured alias: inspect, assert, drain and run what was sent."""
    _database_access(request)
    from .testing import OutboxFixture

    return OutboxFixture()


@pytest.fixture
def outbox_broker(outbox: OutboxFixture) -> InMemoryPublisher:
    """The in-memory broker ``outbox.drain()`` publishes to: ``.published`` envelopes."""
    return outbox.broker


@pytest.fixture
def outbox_drain(outbox: OutboxFixture) -> Callable[..., list[Envelope]]:
    """``outbox.drain``: run the relay until nothing is due; returns the published envelopes."""
    return outbox.drain


@pytest.fixture
def outbox_run(outbox: OutboxFixture) -> Callable[..., list[ExecutedTask]]:
    """``outbox.run_enqueued``: drain and run every message as a worker would."""
    return outbox.run_enqueued
