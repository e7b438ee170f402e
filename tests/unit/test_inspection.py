"""``outbox tasks inspect``'s decisions and the history settings, on values (no database)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management.base import CommandError

from celery_outbox.conf import load_settings
from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.inspection import (
    InspectRequest,
    enqueued_at,
    inspect_message,
    message_state,
)
from celery_outbox.states import row_state
from celery_outbox.store.history import (
    DeadEntry,
    HistoryEntry,
    MessageTrace,
    WaitingRow,
)

T0 = datetime(2026, 5, 1, 8, 0, tzinfo=timezone.utc)
TEXT = InspectRequest("t-1")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def waiting(state: str, **values: Any) -> WaitingRow:
    fields: dict[str, Any] = {
        "id": 7,
        "task_name": "shop.charge",
        "state": state,
        "attempts": 0,
        "last_error": "",
        "created_at": at(0),
        "available_at": at(60),
        "holder": None,
        "holder_name": "",
        **values,
    }
    return WaitingRow(**fields)


def event(name: str, seconds: float, **values: Any) -> HistoryEntry:
    fields: dict[str, Any] = {
        "event": name,
        "task_name": "shop.charge",
        "at": at(seconds),
        "enqueued_at": at(0),
        "attempt": 1,
        "error": "",
        "relay_id": "r" * 32,
        "process": "web-1:812",
        **values,
    }
    return HistoryEntry(**fields)


def dead(seconds: float) -> DeadEntry:
    return DeadEntry(3, "shop.charge", 2, "NotFound: q", at(0), at(seconds))


def trace(
    rows: tuple[WaitingRow, ...] = (),
    dead_letters: tuple[DeadEntry, ...] = (),
    events: tuple[HistoryEntry, ...] = (),
    history: bool = True,
) -> MessageTrace:
    return MessageTrace("t-1", rows, dead_letters, events, history)


def field(report: str, name: str) -> str:
    for line in report.splitlines():
        label, _, value = line.partition("  ")
        if label.strip() == name:
            return value.strip()
    raise AssertionError(f"no {name!r} line in:\n{report}")


@pytest.mark.parametrize(
    ("due", "leased", "attempts", "ordering", "state"),
    [
        (True, False, 0, None, "due"),
        (True, True, 0, None, "due"),  # a lease that ended: any relay may claim it
        (False, True, 0, None, "in_flight"),
        (False, False, 3, None, "retrying"),
        (False, False, 0, None, "deferred"),
        (False, False, 0, "running", "running"),
        (False, False, 1, "blocked", "blocked"),
    ],
)
def test_one_name_per_row_state(
    due: bool, leased: bool, attempts: int, ordering: str | None, state: str
) -> None:
    assert (
        row_state(due=due, leased=leased, attempts=attempts, ordering_state=ordering)
        == state
    )


def test_the_newest_outbox_row_decides() -> None:
    rows = (waiting("deferred", id=1), waiting("in_flight", id=2))
    assert message_state(trace(rows, (dead(5),), (event("published", 9),))) == (
        "in_flight"
    )


def test_without_a_row_the_later_of_dead_and_published_decides() -> None:
    assert message_state(trace((), (dead(5),), (event("published", 9),))) == (
        "published"
    )
    assert message_state(trace((), (dead(10),), (event("published", 9),))) == "dead"
    assert message_state(trace(events=(event("retrying", 1),))) is None


def test_a_revoke_before_publish_is_the_last_word_until_something_happens_after() -> (
    None
):
    revoked = trace(events=(event("retrying", 1), event("revoked", 5, attempt=1)))
    assert message_state(revoked) == "revoked"
    text = inspect_message(revoked, TEXT)
    assert "state        revoked" in text
    assert "before it was published" in text
    # Replayed from a dead letter and published after the revoke: published.
    later = trace((), (dead(2),), (event("revoked", 5), event("published", 9)))
    assert message_state(later) == "published"


def test_the_enqueue_is_the_earliest_record() -> None:
    replayed_row = waiting("due", created_at=at(50))
    assert enqueued_at(trace((replayed_row,), events=(event("dead", 9),))) == at(0)
    assert enqueued_at(trace()) is None


def test_a_retrying_message_says_when_and_why() -> None:
    row = waiting("retrying", attempts=2, last_error="NotFound: no queue 'emails'")
    report = inspect_message(trace((row,)), TEXT)
    assert field(report, "state") == "retrying"
    assert field(report, "next try") == "2026-05-01 08:01:00.000 UTC"
    assert field(report, "last error") == "NotFound: no queue 'emails'"
    assert "history: no event yet" in report


def test_a_lease_without_heartbeat_says_so() -> None:
    row = waiting("in_flight", holder="h" * 32, holder_name="")
    report = inspect_message(trace((row,)), TEXT)
    assert field(report, "leased to") == f"relay (heartbeat gone) ({'h' * 32})"


def test_a_published_message_says_by_whom() -> None:
    report = inspect_message(
        trace(
            events=(event("retrying", 1, error="NotFound: q"), event("published", 3))
        ),
        TEXT,
    )
    assert field(report, "state") == "published"
    assert field(report, "published") == "2026-05-01 08:00:03.000 UTC"
    assert field(report, "by") == f"relay web-1:812 ({'r' * 32})"
    history = report.split("history:\n")[1].splitlines()
    assert [line.split()[3] for line in history] == ["retrying", "published"]
    assert history[0].endswith("reason: NotFound: q")


def test_a_replay_shows_the_last_broker_reason() -> None:
    replayed = event("replayed", 4, error="NotFound: q", relay_id=None)
    report = inspect_message(trace(events=(event("published", 6), replayed)), TEXT)
    line = report.split("history:\n")[1].splitlines()[1]
    assert line.endswith("by web-1:812  last reason: NotFound: q")


def test_history_off_is_said() -> None:
    report = inspect_message(trace((waiting("due"),), history=False), TEXT)
    assert "history: off" in report


def test_an_unknown_task_id_is_an_error() -> None:
    with pytest.raises(CommandError, match="no message with task id 't-1'") as raised:
        inspect_message(trace(history=False), TEXT)
    assert "CELERY_OUTBOX_HISTORY is off" in str(raised.value)
    with pytest.raises(CommandError) as raised:
        inspect_message(trace(history=True), TEXT)
    assert "CELERY_OUTBOX_HISTORY" not in str(raised.value)


def test_json_carries_times_in_iso_8601() -> None:
    report = json.loads(
        inspect_message(trace((), (dead(5),)), InspectRequest("t-1", "json"))
    )
    assert report["state"] == "dead"
    assert report["enqueued_at"] == "2026-05-01T08:00:00+00:00"
    assert report["dead"][0]["dead_at"] == "2026-05-01T08:00:05+00:00"


def test_the_request_refuses_a_blank_task_id() -> None:
    with pytest.raises(CommandError, match="give a task id"):
        InspectRequest.parse(task_id="  ", format="text")


def test_history_settings() -> None:
    def load(**values: Any) -> Any:
        return load_settings(
            SimpleNamespace(**{f"CELERY_OUTBOX_{k}": v for k, v in values.items()})
        )

    assert (load().history, load().history_retention) == (False, 7 * 86400.0)
    loaded = load(HISTORY=True, HISTORY_RETENTION="36h")
    assert (loaded.history, loaded.history_retention) == (True, 36 * 3600.0)
    with pytest.raises(OutboxConfigurationError, match="HISTORY must be True or False"):
        load(HISTORY="yes")
    with pytest.raises(OutboxConfigurationError, match="finite duration"):
        load(HISTORY_RETENTION=None)
