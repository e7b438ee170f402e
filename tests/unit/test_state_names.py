"""One name per state: the admin's state column uses the names stats and metrics use."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_outbox.admin import message_state
from celery_outbox.store.types import Summary

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
LATER = NOW + timedelta(seconds=30)


@pytest.mark.parametrize(
    ("lease", "available_at", "attempts", "state"),
    [
        (None, NOW, 0, "due"),
        ("token", LATER, 0, "in_flight"),
        (None, LATER, 2, "retrying"),
        (None, LATER, 0, "deferred"),
    ],
)
def test_each_state_has_one_name(
    lease: str | None, available_at: datetime, attempts: int, state: str
) -> None:
    assert message_state(lease, available_at, attempts, NOW) == state


def test_the_counted_states_are_the_summarys_fields() -> None:
    counted = {"due", "in_flight", "retrying"}
    assert counted <= set(Summary.__dataclass_fields__)
