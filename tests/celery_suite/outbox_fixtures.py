"""Fixtures that run Celery's integration suite through ``OutboxCelery`` and a relay.

``run.py`` appends ``from tests.celery_suite.outbox_fixtures import *`` to the copy of
Celery's ``t/integration/conftest.py``: the names defined here then replace the
suite's ``celery_app`` and ``celery_session_app`` (the apps are OutboxCelery, built
from the same configuration as Celery's ``TestApp`` builds them), and a real relay
runs on a thread for the whole session, publishing what the tests send. Everything
else (the session worker, the result backend, the tests) is Celery's own.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.celery_suite.settings")
django.setup()

from celery_outbox import OutboxCelery  # noqa: E402 (needs Django set up)

__all__ = ["celery_app", "celery_session_app"]


@contextmanager
def outbox_test_app(
    config: dict[str, Any], enable_logging: bool, use_trap: bool, parameters: Any
) -> Iterator[OutboxCelery]:
    """An OutboxCelery configured as ``celery.contrib.testing.app.TestApp`` does."""
    from celery.contrib.testing import tasks  # noqa: F401 (the ping task, as TestApp)
    from celery.contrib.testing.app import (
        DEFAULT_TEST_CONFIG,
        UnitLogging,
        setup_default_app,
    )

    app = OutboxCelery(
        "celery.tests",
        set_as_current=False,
        log=None if enable_logging else UnitLogging,
        **(parameters or {}),
    )
    app.add_defaults(dict(copy.deepcopy(DEFAULT_TEST_CONFIG), **config))
    with setup_default_app(app, use_trap=use_trap):
        yield app


def _app(request: Any) -> Any:
    """The app ``celery.contrib.pytest`` would build for ``request``, an OutboxCelery."""
    mark = request.node.get_closest_marker("celery")
    config = dict(request.getfixturevalue("celery_config"))
    config.update(mark.kwargs if mark else {})
    return outbox_test_app(
        config,
        request.getfixturevalue("celery_enable_logging"),
        request.getfixturevalue("use_celery_app_trap"),
        request.getfixturevalue("celery_parameters"),
    )


@pytest.fixture(scope="session")
def celery_session_app(request: Any) -> Iterator[OutboxCelery]:
    """The session app (the worker's), an OutboxCelery, and the relay."""
    with _app(request) as app:
        if not request.getfixturevalue("use_celery_app_trap"):
            app.set_default()
            app.set_current()
        with outbox_relay(app):
            yield app


@pytest.fixture
def celery_app(request: Any) -> Iterator[OutboxCelery]:
    """Each test's app, an OutboxCelery."""
    with _app(request) as app:
        yield app


@contextmanager
def outbox_relay(app: OutboxCelery) -> Iterator[None]:
    """The outbox tables, and a relay on a thread while the session runs.

    Up before the session worker starts: it checks itself with a ping task, which
    goes through the outbox like any other.
    """
    from django.core.management import call_command
    from django.db import connections

    from celery_outbox.broker import build_publisher
    from celery_outbox.cli.runner import build_relay
    from celery_outbox.conf import get_settings
    from celery_outbox.relay.sent import sent_event_observers

    call_command("migrate", verbosity=0)
    connections.close_all()
    settings = get_settings()
    # The relay publishes with the session app's broker configuration (the test
    # apps share it); several OutboxCelery exist, so it is named here.
    relay = build_relay(settings, publisher=build_publisher(app, settings))
    relay.observers.extend(sent_event_observers(app))

    def run() -> None:
        try:
            relay.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="outbox-relay", daemon=True)
    thread.start()
    yield
    relay.stop()
    thread.join(30)
