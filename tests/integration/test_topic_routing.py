"""Events reach the same handlers on Redis as on RabbitMQ: one table, both brokers.

Every service below handles one pattern; every event below is fired once in its own
transaction and published by a real relay; each service's queue is then read. On
RabbitMQ the broker routes; on Redis kombu's topic exchange did, and its ``#`` needed
a word (``order.#`` missed ``order``, silently).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.db import transaction
from django.test import override_settings
from kombu import Connection

from celery_outbox import OutboxCelery
from celery_outbox.conf import get_settings
from celery_outbox.events.declare import declare
from celery_outbox.events.registry import registry_of
from celery_outbox.models import OutboxMessage

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .test_events import relay_until_empty

pytestmark = pytest.mark.django_db(transaction=True)

EVENTS = ["order", "order.created", "order.created.eu", "order.eu", "invoice.created"]
#: Handler pattern -> the events RabbitMQ's topic rules route to it.
ROUTED = {
    "order.#": ["order", "order.created", "order.created.eu", "order.eu"],
    "order.*": ["order.created", "order.eu"],
    "#.created": ["order.created", "invoice.created"],
    "order.#.eu": ["order.created.eu", "order.eu"],
    "*.created.#": ["order.created", "order.created.eu", "invoice.created"],
}


class Services:
    """One service per pattern, under an events exchange of this test only."""

    def __init__(self, broker: str) -> None:
        self.broker = broker
        self.exchange = f"test-topics-{uuid.uuid4().hex[:8]}"
        self.queues: list[str] = []
        self.apps: list[OutboxCelery] = []

    def app(self, name: str) -> OutboxCelery:
        app = OutboxCelery(name, set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        app.conf.update(broker_url=self.broker)
        self.apps.append(app)
        return app

    def handle(self, number: int, pattern: str) -> str:
        """A service handling ``pattern``; returns its queue."""
        app = self.app(f"svc{number}-{self.exchange[-8:]}")
        registry_of(app).add_handler(pattern, lambda *args: None)
        topology = registry_of(app).topology()
        with Connection(self.broker) as connection:
            declare(connection, topology.all_queues(), get_settings(), app.main)
        queue = topology.queue_name(pattern)
        self.queues.append(queue)
        return queue

    def events_in(self, queue: str) -> list[str]:
        """The names of the events waiting in ``queue`` (taken from it)."""
        found: list[str] = []
        with Connection(self.broker) as connection:
            channel: Any = connection.default_channel
            while (message := channel.basic_get(queue, no_ack=True)) is not None:
                found.append(json.loads(message.body)[0][0])
        return sorted(found)

    def cleanup(self) -> None:
        if self.broker.startswith("redis://"):
            client = redis.Redis.from_url(self.broker)
            for pattern in (f"{self.exchange}*", f"_kombu.binding*{self.exchange}*"):
                for key in client.scan_iter(pattern):
                    client.delete(key)
            client.close()
            return
        with Connection(self.broker, connect_timeout=5) as connection:
            channel = connection.channel()
            for queue in [*self.queues, f"{self.exchange}:unrouted"]:
                channel.queue_delete(queue)
            for exchange in (self.exchange, f"{self.exchange}:unrouted"):
                channel.exchange_delete(exchange)
            channel.close()


@pytest.fixture(params=[BROKER_AMQP, BROKER_REDIS], ids=["rabbitmq", "redis"])
def services(request: pytest.FixtureRequest) -> Iterator[Services]:
    found = Services(request.param)
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
    shop = services.app(f"shop-{services.exchange[-8:]}")
    fire = {name: shop.event(name)(lambda name: None) for name in EVENTS}
    for name in EVENTS:
        with transaction.atomic():
            fire[name](name)  # the event's own name as its argument
    relay_until_empty(shop)
    got = {pattern: services.events_in(queue) for pattern, queue in queues.items()}
    assert got == {pattern: sorted(names) for pattern, names in ROUTED.items()}
    assert OutboxMessage.objects.count() == 0  # every event reached a queue
