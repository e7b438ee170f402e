"""Every way a subscriber ends an event on a real worker settles it once: retried on
the lane's schedule and archived, archived at once, or done; never run again for ever.

The ``endings`` service (``tests/events_project/endings.py``) has subscribers that
end each event as its argument says: with a soft time limit of 1 s and a hard one of
2 s, or killing their own process, with two retry steps (1 s, 2 s). A prefork worker
runs them, on RabbitMQ (retries in TTL queues) and on Redis (retries in the outbox);
a relay publishes. The test waits for what a user checks: how often the subscriber
started, what the archive holds, and that nothing is left to come back.

A revoke (in the queue, past ``expires``, or ``terminate=True``) drops the copy as
Celery does, before and after the endings were settled here: not tested again.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import transaction
from kombu import Connection

from celery_outbox import OutboxCelery
from celery_outbox.conf import get_settings
from celery_outbox.events import archive, dbarchive
from celery_outbox.events.archive import ArchivedEvent
from celery_outbox.events.topology import ServiceTopology
from celery_outbox.models import OutboxMessage
from tests.events_project.endings import STEPS

from ..integration.test_events import delete_topology
from .conftest import BROKER_AMQP, BROKER_REDIS, Stack, wait_until
from .test_events import STEPS as DECLARED_STEPS
from .test_events import Events, event_stack

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(databases="__all__", transaction=True),
]

SERVICE = "endings"
PATTERNS = ("trial.*", "other.*")
BROKERS = pytest.mark.parametrize(
    "broker", [BROKER_AMQP, BROKER_REDIS], ids=["rabbitmq", "redis"]
)


class Endings:
    """The endings service's worker and what it recorded, on one test's exchange."""

    def __init__(self, events: Events, app: OutboxCelery) -> None:
        self.events = events
        self.app = app
        self.topology = ServiceTopology(get_settings(), SERVICE, PATTERNS)

    @property
    def stack(self) -> Stack:
        return self.events.stack

    def fire(self, event: str, number: int, how: str) -> None:
        """Fire ``event`` with (``number``, ``how``) and commit."""
        fired = self.app.event(event)(lambda *args: None)
        with transaction.atomic():
            fired(number, how)

    def starts(self, number: int) -> list[dict[str, Any]]:
        return [
            r for r in self.events.records(SERVICE, "start") if r["payload"] == number
        ]

    def done(self, number: int) -> bool:
        return any(r["payload"] == number for r in self.events.records(SERVICE, "done"))

    def archived(self) -> list[ArchivedEvent]:
        """The service's archive, oldest first."""
        if self.events.on_redis:
            return dbarchive.list_archive(self.topology)
        with Connection(BROKER_AMQP, connect_timeout=5) as connection:
            return archive.list_archive(connection, self.topology)

    def wait_archived(self, event: str, timeout: float = 40) -> ArchivedEvent:
        """Wait until ``event`` is in the archive; its archived copy."""

        def found() -> list[ArchivedEvent]:
            return [each for each in self.archived() if each.event == event]

        wait_until(
            lambda: bool(found()), timeout, f"{event} archived",
            lambda: f"{self.archived()}; starts {self.events.records(SERVICE, 'start')}",
        )  # fmt: skip
        (archived,) = found()
        return archived

    def settled(self) -> None:
        """Nothing of this service waits to run again: no retry row in the outbox,
        no copy ready in its queues (retry steps included, the archive left out)."""
        rows = OutboxMessage.objects.all()
        wait_until(lambda: not rows.exists(), 30, "no retry waiting in the outbox")
        names = [q.name for q in self.topology.all_queues()]
        names.remove(self.topology.archive_name)
        with Connection(self.stack.broker, connect_timeout=5) as connection:
            wait_until(
                lambda: not any(archive.stats(connection, self.topology).get(n) for n in names),
                30, "the service's queues empty",
            )  # fmt: skip


@contextlib.contextmanager
def endings_service(e2e: Callable[..., Stack], broker: str) -> Iterator[Endings]:
    with event_stack(e2e, broker, prefix="test-endings") as events:
        app = OutboxCelery(f"fire-{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        try:
            events.start_service(SERVICE, pool="prefork", concurrency=4)
            events.stack.start_relay()
            yield Endings(events, app)
        finally:
            events.stack.stop_all()
            if not events.on_redis:
                delete_topology(events.exchange, [SERVICE], DECLARED_STEPS, PATTERNS)
                with Connection(BROKER_AMQP, connect_timeout=5) as connection:
                    channel = connection.channel()
                    channel.queue_delete(f"{events.exchange}:{SERVICE}:tasks")
                    channel.exchange_delete(f"{events.exchange}:{SERVICE}:tasks")
                    channel.close()


#: How a subscriber ends each event: (event, how, runs, the archived error or None).
#: Counted endings run 1 + STEPS times and are archived with ``retries`` STEPS.
ENDINGS = [
    ("trial.ok", "ok", 1, None),
    ("trial.fail", "fail", 1 + STEPS, "RuntimeError('failing on purpose')"),
    ("trial.hard", "hard", 1 + STEPS, "TimeLimitExceeded"),
    ("trial.soft", "soft", 1 + STEPS, "SoftTimeLimitExceeded"),
    ("other.lost", "lost", 1 + STEPS, "WorkerLostError"),
    ("trial.ignore", "ignore", 1, None),
    ("trial.reject", "reject", 1, "reject requeue=False: rejected on purpose"),
    ("trial.requeue", "requeue", 1 + STEPS, "reject requeue=True: requeued on purpose"),
]


@BROKERS
def test_every_ending_of_a_subscriber_is_settled_once_and_counted(
    e2e: Any, broker: str
) -> None:
    """Each event fired once, all at once: those that fail (raising, past a time
    limit, killing their process, requeueing the event) take every retry step,
    then the archive; a rejected one is archived at once; an ignored one is done."""
    with endings_service(e2e, broker) as service:
        for number, (event, how, _, _) in enumerate(ENDINGS):
            service.fire(event, number, how)
        for event, _, _, error in ENDINGS:
            if error is not None:
                archived = service.wait_archived(event)
                assert error in archived.error, event
        service.settled()
        kept = {each.event: each for each in service.archived()}
        for number, (event, how, runs, error) in enumerate(ENDINGS):
            assert len(service.starts(number)) == runs, event
            assert service.done(number) is (how == "ok"), event
            if error is None:
                assert event not in kept
            else:
                assert kept[event].retries == runs - 1, event
        service.stack.assert_alive()
