"""Scheduled tasks as values: which ETA waits in the outbox, and when the relay wakes.

The decisions of ``celery_outbox.scheduling`` over header values, and the real relay
loop on an in-memory store and a fake clock: an idle relay sleeps until the next
scheduled row falls due instead of polling, and publishes it then.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from django.test import override_settings

from celery_outbox.conf import OutboxConfigurationError, get_settings, load_settings
from celery_outbox.relay.observations import Idle, RelayObservation
from celery_outbox.scheduling import far_eta, schedule
from celery_outbox.states import SCHEDULED, message_state

from ..integration.builders import envelope
from .test_relay_loop import World

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)


def headers(
    eta: datetime | str | None, expires: str | None = None
) -> dict[str, object]:
    value = eta.isoformat() if isinstance(eta, datetime) else eta
    return {"eta": value, "expires": expires}


def test_an_eta_beyond_the_threshold_is_scheduled_with_its_delay() -> None:
    message = envelope("t")
    later = schedule(message, headers(NOW + timedelta(minutes=5)), after=60, now=NOW)
    assert later.due_in == 300.0
    assert later.dead_reason == ""
    assert later.body == message.body and later.headers == message.headers


@pytest.mark.parametrize(
    ("eta", "after"),
    [
        (None, 60),  # no ETA: Celery's header is None
        (NOW + timedelta(seconds=60), 60),  # at the threshold: not beyond it
        (NOW - timedelta(hours=1), 60),  # in the past
        (NOW + timedelta(hours=1), None),  # scheduling off
        ("not a time", 60),
    ],
)
def test_other_messages_are_left_as_they_are(
    eta: datetime | str | None, after: float | None
) -> None:
    message = envelope("t")
    assert schedule(message, headers(eta), after=after, now=NOW) is message


def test_a_naive_eta_is_utc_whatever_the_apps_timezone_as_the_worker_reads_it() -> None:
    # Celery's worker reads a naive 12:30 as 12:30 UTC, in Paris as in Tokyo: 30
    # minutes after NOW (tests/unit/test_worker_reading.py holds it to the worker).
    naive = "2026-05-01T12:30:00"
    for zone in (ZoneInfo("Europe/Paris"), ZoneInfo("Asia/Tokyo"), timezone.utc):
        later = schedule(envelope("t"), headers(naive), after=60, zone=zone, now=NOW)
        assert later.due_in == 1800.0
    aware = "2026-05-01T14:30:00+02:00"  # an offset is kept: 12:30 UTC too
    later = schedule(envelope("t"), headers(aware), after=60, now=NOW)
    assert later.due_in == 1800.0


def test_a_task_that_expires_before_its_eta_gets_the_dead_letters_reason() -> None:
    eta = NOW + timedelta(hours=1)
    doomed = schedule(
        envelope("t"),
        headers(eta, (NOW + timedelta(minutes=1)).isoformat()),
        after=60,
        now=NOW,
    )
    assert doomed.dead_reason.startswith("expired before due: the task expires at ")
    assert eta.isoformat() in doomed.dead_reason
    kept = schedule(
        envelope("t"),
        headers(eta, (eta + timedelta(minutes=1)).isoformat()),
        after=60,
        now=NOW,
    )
    assert kept.dead_reason == ""


@pytest.mark.parametrize(
    ("options", "far"),
    [
        ({"countdown": 3600}, True),
        ({"countdown": 30}, False),
        ({"countdown": 30, "eta": NOW + timedelta(hours=1)}, False),  # countdown wins
        ({"eta": NOW + timedelta(hours=1)}, True),
        ({"eta": (NOW + timedelta(hours=1)).isoformat()}, True),
        ({"eta": datetime(2026, 5, 1, 13, 0)}, True),  # naive: UTC, an hour ahead
        ({"eta": datetime(2026, 5, 1, 12, 0, 30)}, False),  # naive: 30 s ahead
        ({"eta": NOW + timedelta(seconds=10)}, False),
        ({}, False),
    ],
)
def test_far_eta_reads_celerys_options(options: dict[str, object], far: bool) -> None:
    assert far_eta(options, 60, now=NOW) is far
    # The app's timezone never moves a naive ETA (Celery's worker reads it as UTC).
    assert far_eta(options, 60, zone=ZoneInfo("Asia/Tokyo"), now=NOW) is far
    assert far_eta(options, None, now=NOW) is False


def test_the_setting_takes_none_or_seconds_and_refuses_the_rest() -> None:
    assert get_settings().schedule_after == 60.0  # the default

    class Source:
        CELERY_OUTBOX_SCHEDULE_AFTER = None

    assert load_settings(Source).schedule_after is None
    Source.CELERY_OUTBOX_SCHEDULE_AFTER = 0  # type: ignore[assignment]
    assert load_settings(Source).schedule_after == 0.0
    for bad in (-1, "1h", True, float("inf")):
        Source.CELERY_OUTBOX_SCHEDULE_AFTER = bad  # type: ignore[assignment]
        with pytest.raises(
            OutboxConfigurationError, match="SCHEDULE_AFTER must be None"
        ):
            load_settings(Source)


def test_a_scheduled_row_has_its_own_state_name() -> None:
    later = NOW + timedelta(hours=1)
    assert message_state(None, later, 0, NOW, due_at=later) == SCHEDULED
    assert message_state(None, later, 0, NOW) == "deferred"
    assert message_state("token", later, 0, NOW, due_at=later) == "in_flight"
    assert message_state(None, NOW, 0, NOW, due_at=later) == "due"  # retried now


def run_until_published(world: World, count: int) -> list[float]:
    """Run the relay until ``count`` messages went out; the idle waits it chose."""

    def stop_when_done(event: RelayObservation) -> None:
        if len(world.published()) >= count:
            world.relay.stop()

    world.relay.observers.append(stop_when_done)
    world.relay.run()
    return [e.seconds for e in world.events if isinstance(e, Idle)]


def test_an_idle_relay_sleeps_until_the_next_row_is_due_then_publishes_it() -> None:
    world = World(poll_interval=30.0)
    soon, later = envelope("soon", due_in=90.0), envelope("later", due_in=3600.0)
    world.store.add([later, soon])
    start = world.clock()

    waits = run_until_published(world, 1)

    assert world.published() == [soon.task_id]
    assert world.clock() - start == pytest.approx(90.0)  # on time, to the tick
    # Each empty look doubles the wait up to the poll interval, never past the
    # moment the next row falls due: a dozen looks in 90 s, none in a loop.
    assert max(waits) == 30.0
    assert len(waits) < 16
    assert sum(waits[:-1]) == pytest.approx(90.0)  # the last: after the publish


def test_a_relay_polls_as_before_when_nothing_is_scheduled() -> None:
    world = World(poll_interval=1.0)
    world.clock.advance(0)
    waits: list[float] = []

    def stop_after_a_while(event: RelayObservation) -> None:
        if isinstance(event, Idle):
            waits.append(event.seconds)
            if len(waits) == 12:
                world.relay.stop()

    world.relay.observers.append(stop_after_a_while)
    world.relay.run()
    assert waits[:3] == [0.01, 0.02, 0.04]
    assert waits[-3:] == [1.0, 1.0, 1.0]  # the adaptive poll alone decides


@override_settings(CELERY_OUTBOX_SCHEDULE_AFTER=None)
def test_settings_are_read_again_when_changed() -> None:
    assert get_settings().schedule_after is None
