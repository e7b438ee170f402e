"""Events reach the same subscribers on Redis as on RabbitMQ: one table, both brokers.

Every service below handles one pattern; every event below is fired once in its own
transaction and published by a real relay; each service's queue is then read. On
RabbitMQ the broker routes; on Redis kombu's topic exchange did, and its ``#`` needed
a word (``order.#`` missed ``order``, silently).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import transaction
from django.test import override_settings

from celery_outbox.events.registry import registry_of
from celery_outbox.models import OutboxMessage

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .test_events import HeldServices, delete_topology, relay_until_empty

pytestmark = pytest.mark.django_db(transaction=True)

EVENTS = ["order", "order.created", "order.created.eu", "order.eu", "invoice.created"]
#: Subscriber pattern -> the events RabbitMQ's topic rules route to it.
ROUTED = {
    "order.#": ["order", "order.created", "order.created.eu", "order.eu"],
    "order.*": ["order.created", "order.eu"],
    "#.created": ["order.created", "invoice.created"],
    "order.#.eu": ["order.created.eu", "order.eu"],
    "*.created.#": ["order.created", "order.created.eu", "invoice.created"],
}


class Services(HeldServices):
    """One service per pattern, under an events exchange of this test only."""

    def handle(self, number: int, pattern: str) -> str:
        """A service handling ``pattern``; returns its queue."""
        app = self.app(f"svc{number}")
        registry_of(app).add_subscriber(pattern, lambda *args: None)
        return self.declare(app).queue_name(pattern)

    def cleanup(self) -> None:
        if self.on_redis:
            super().cleanup()
        else:
            delete_topology(self.exchange, self.services, 0, tuple(ROUTED))


@pytest.fixture(params=[BROKER_AMQP, BROKER_REDIS], ids=["rabbitmq", "redis"])
def services(request: pytest.FixtureRequest) -> Iterator[Services]:
    found = Services(f"test-topics-{uuid.uuid4().hex[:8]}", request.param)
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=found.exchange,
        CELERY_OUTBOX_EVENTS_RETRIES="database",
    ):
        try:
            yield found
        finally:
            found.cleanup()


def test_each_pattern_gets_the_events_rabbitmqs_topic_rules_route_to_it(
    services: Services,
) -> None:
    queues = {pattern: services.handle(n, pattern) for n, pattern in enumerate(ROUTED)}
    shop = services.app("shop")
    fire = {name: shop.event(name)(lambda name: None) for name in EVENTS}
    for name in EVENTS:
        with transaction.atomic():
            fire[name](name)  # the event's own name as its argument
    relay_until_empty(shop)
    got = {pattern: services.ids_in(queue) for pattern, queue in queues.items()}
    assert got == {pattern: sorted(names) for pattern, names in ROUTED.items()}
    assert OutboxMessage.objects.count() == 0  # every event reached a queue
