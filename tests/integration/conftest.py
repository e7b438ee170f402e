"""Fixtures for tests against real databases and brokers."""

from __future__ import annotations

import pytest
from django.conf import settings

#: Every database the store must work on, whatever OUTBOX_TEST_DB made the default.
ALIASES = list(settings.DATABASES)


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    """Each database alias in turn (PostgreSQL, MariaDB, SQLite)."""
    return str(request.param)
