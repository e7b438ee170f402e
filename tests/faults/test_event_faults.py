"""Events fired while RabbitMQ is down: the outbox holds them, no committed event is lost.

Two services of ``tests/events_project`` (billing, shipping) run real prefork
workers, a real relay publishes; events are fired in transactions (every fifth
rolled back) before, during and after a RabbitMQ outage (``rabbitmqctl stop_app``,
then ``start_app``). Stops the shared RabbitMQ: run it alone, never beside other
test runs.

The delivery is **at least once**, so the test asserts at least once and reports the
duplicates: the relay publishes with confirms and sends a row again when the
connection went away before its confirm arrived, and the delivering task acks late
(``acks_late=True``), so a subscriber that ran while the broker went away loses its ack
with the connection and the broker delivers that event again once it is back.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import transaction

from celery_outbox.models import DeadLetter, OutboxMessage
from tests.e2e.conftest import WORKER_HEARTBEAT, Proc, Stack, wait_until
from tests.e2e.test_events import Events, event_stack

from ..conftest import BROKER_AMQP
from ..integration.test_events import order_created_fixture  # noqa: F401
from .test_faults import rabbitmqctl

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

E2E = Callable[..., Stack]
SERVICES = ("billing", "shipping")
#: Every event whose number is a multiple of this is rolled back.
ROLLBACK_EVERY = 5
#: Events fired before the outage, and after it.
BEFORE = 500
AFTER = 500
#: How long RabbitMQ stays stopped (s), and the most events fired meanwhile.
OUTAGE_SECONDS = 5.0
DURING_MAX = 400
#: The stop comes once billing handled this many events (the rest are under way).
STOP_AFTER_HANDLED = 100
#: After every committed event was handled: time for a late copy to arrive.
GRACE = 3.0


@dataclass
class Fired:
    """What was fired: the numbers committed, rolled back, and the calls that raised."""

    committed: set[int] = field(default_factory=set)
    rolled_back: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.committed) + len(self.rolled_back) + len(self.errors)


def fire(
    event: Any,
    numbers: Iterable[int],
    fired: Fired,
    *,
    until: float | None = None,
    pause: float = 0.0,
) -> int:
    """Fire ``event`` once per number, each in its own transaction; returns how many.

    A call that raises is recorded in ``fired.errors`` (and rolled back), not raised:
    the test says afterwards whether any did. ``until``: stop at this monotonic time.
    """
    count = 0
    for number in numbers:
        if until is not None and time.monotonic() >= until:
            break
        count += 1
        rollback = number % ROLLBACK_EVERY == 0
        try:
            with transaction.atomic():
                event(number, "9.90")
                if rollback:
                    transaction.set_rollback(True)
        except Exception as exc:
            fired.errors.append(f"event {number}: {exc!r}")
            continue
        (fired.rolled_back if rollback else fired.committed).add(number)
        if pause:
            time.sleep(pause)
    return count


def handled(events: Events, service: str) -> Counter[int]:
    """How many times ``service``'s subscriber completed each event."""
    return Counter(int(row["payload"]) for row in events.records(service, "done"))


def start_service(events: Events, service: str) -> Proc:
    """A prefork worker of ``service``: the threads pool shares one connection between
    its threads, which can corrupt frames while it reconnects after the outage."""
    return events.start_service(
        service,
        pool="prefork",
        concurrency=2,
        env={"OUTBOX_TEST_BROKER_HEARTBEAT": str(WORKER_HEARTBEAT)},
    )


@pytest.fixture
def events(e2e: E2E) -> Iterator[Events]:
    """A stack on RabbitMQ whose workers are event services, on an exchange of this
    test; its queues, exchanges and records are deleted afterwards."""
    with event_stack(e2e, BROKER_AMQP, prefix="test-event-faults") as helper:
        yield helper


@pytest.mark.django_db(transaction=True)
def test_events_fired_during_a_rabbitmq_outage_are_all_handled(
    events: Events, order_created: Any, measured: list[str]
) -> None:
    for service in SERVICES:
        start_service(events, service)
    events.stack.start_relay("--broker-outage-cooldown", "1")
    fired = Fired()
    fire(order_created, range(BEFORE), fired)
    wait_until(
        lambda: sum(handled(events, "billing").values()) >= STOP_AFTER_HANDLED,
        60,
        f"billing to handle {STOP_AFTER_HANDLED} events before the outage",
    )
    handled_at_stop = sum(handled(events, "billing").values())
    committed_before = len(fired.committed)
    rabbitmqctl("stop_app")
    try:
        stopped = time.monotonic()
        numbers = range(10_000, 10_000 + DURING_MAX)
        during = fire(
            order_created,
            numbers,
            fired,
            until=stopped + OUTAGE_SECONDS,
            pause=0.005,
        )
        committed_during = len(fired.committed) - committed_before
        # Nothing can be published now: every event committed meanwhile is a row.
        held = OutboxMessage.objects.count()
        attempts = max(
            OutboxMessage.objects.values_list("attempts", flat=True), default=0
        )
        time.sleep(max(0.0, stopped + OUTAGE_SECONDS - time.monotonic()))
    finally:
        rabbitmqctl("start_app")
    restarted = time.monotonic()
    fire(order_created, range(20_000, 20_000 + AFTER), fired)
    for service in SERVICES:
        wait_until(
            lambda: set(handled(events, service)) >= fired.committed,  # noqa: B023
            240,
            f"{service} to handle every committed event",
            lambda: f"{len(fired.committed - set(handled(events, service)))} missing",  # noqa: B023
        )
    recovery = time.monotonic() - restarted
    wait_until(lambda: not OutboxMessage.objects.exists(), 60, "the outbox to drain")
    time.sleep(GRACE)

    counts = {service: handled(events, service) for service in SERVICES}
    duplicates = {
        service: sum(n - 1 for n in ran.values() if n > 1)
        for service, ran in counts.items()
    }
    committed = len(fired.committed)
    per_service = " ".join(
        f"{service}={len(ran)}/{committed} (+{duplicates[service]} duplicates)"
        for service, ran in counts.items()
    )
    line = (
        f"events, RabbitMQ stop_app {OUTAGE_SECONDS:.0f} s: fired={fired.count} "
        f"committed={committed} (during the outage fired={during} "
        f"committed={committed_during}, rows held at the restart={held}, "
        f"handled by billing at the stop={handled_at_stop}) handled {per_service} "
        f"errors={len(fired.errors)} recovery={recovery:.1f}s"
    )
    print(line)
    measured.append(line)

    assert fired.errors == [], "firing raised while RabbitMQ was down"
    assert committed_during > 0, "no event was committed during the outage: no proof"
    assert held >= committed_during, "events fired during the outage left the outbox"
    assert attempts == 0, "the outage used up publish attempts"
    for service, ran in counts.items():
        assert not fired.committed - set(ran), f"{service} lost committed events"
        assert not fired.rolled_back & set(ran), f"{service} ran rolled-back events"
        assert not set(ran) - fired.committed, f"{service} ran events never committed"
    assert DeadLetter.objects.count() == 0
    events.stack.assert_alive()
