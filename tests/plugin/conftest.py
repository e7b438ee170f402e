"""Fixtures for the pytest plugin's tests."""

from __future__ import annotations

import pytest
from django.conf import settings

#: Every database the plugin must work on, whatever OUTBOX_TEST_DB made the default.
ALIASES = list(settings.DATABASES)


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, settings: object) -> str:
    """Each database alias in turn, made the outbox alias for the test."""
    name = str(request.param)
    settings.CELERY_OUTBOX_DATABASE = name  # type: ignore[attr-defined]
    return name
