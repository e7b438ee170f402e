"""``queued`` counts a task until a worker starts it, however long it waits (#44).

A real relay, a real broker (RabbitMQ, Redis) and every database: a key's task
waits in a queue no worker reads, longer than the flow's lease. It keeps its slot
(the key's next task stays parked, the stats say queued 1) for as long as the queue
holds it; once the broker has lost it (the queue purged), its slot frees at the
next lease and the next task goes.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.db import transaction
from kombu import Connection, Queue

from celery_outbox.broker import Publisher
from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.broker.base import queue_depth
from celery_outbox.broker.redis import RedisPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.flow.gate import FlowGate
from celery_outbox.flow_limits import KEY_HEADER, Flow, parse_limits
from celery_outbox.models import OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.states import PARKED
from celery_outbox.store import Stores

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

LEASE = 1.0
PARTNER = Flow(
    "partner", ("shop.call_partner",), (), parse_limits({"queued": 1}), LEASE
)
FAST = OutboxSettings(poll_interval=0.05, retry_base_seconds=0.01)


class Broker:
    """A queue of the test's own on a real broker, and a way to lose its messages."""

    def __init__(self, url: str, make: Callable[..., Publisher]) -> None:
        self.url = url
        self.queue = f"outbox-queued-{uuid.uuid4().hex[:10]}"
        self.publisher = make(
            lambda: Connection(url, connect_timeout=2),
            lambda name: Queue(name, routing_key=name),
        )

    def waiting(self) -> int:
        depth = queue_depth(self.publisher)
        assert depth is not None
        return depth([self.queue])[self.queue]

    def lose_everything(self) -> None:
        if self.url == BROKER_REDIS:
            client = redis.Redis.from_url(self.url)
            client.delete(*client.keys(f"{self.queue}*"))
            client.close()
            return
        with Connection(self.url) as connection:
            channel = connection.channel()
            channel.queue_purge(self.queue)
            channel.close()

    def task_ids(self) -> list[str]:
        """The task ids the queue holds, oldest first (RabbitMQ's are taken)."""
        if self.url == BROKER_REDIS:
            client = redis.Redis.from_url(self.url)
            entries = client.lrange(self.queue, 0, -1)
            client.close()
            return [json.loads(e)["headers"]["id"] for e in reversed(entries)]
        taken = []
        with Connection(self.url) as connection:
            channel = connection.channel()
            while (message := channel.basic_get(self.queue, no_ack=True)) is not None:
                taken.append(message.headers["id"])
            channel.close()
        return taken

    def close(self) -> None:
        self.publisher.close()
        with contextlib.suppress(Exception):
            self.lose_everything()
        if self.url == BROKER_AMQP:
            with Connection(self.url) as connection:
                channel = connection.channel()
                channel.queue_delete(self.queue)
                channel.close()


BROKERS: dict[str, Callable[[], Broker]] = {
    "rabbitmq": lambda: Broker(
        BROKER_AMQP, lambda c, r: AmqpPublisher(c, r, confirm=True)
    ),
    "redis": lambda: Broker(BROKER_REDIS, RedisPublisher),
}


@pytest.fixture(params=list(BROKERS))
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    made = BROKERS[request.param]()
    try:
        yield made
    finally:
        made.close()


def relay_once(alias: str, broker: Broker) -> None:
    """One relay run until nothing is due, with the flow gate a relay builds."""
    gate = FlowGate(
        [PARTNER], Stores(alias).flows(), depth=queue_depth(broker.publisher)
    )
    config = RelayConfig.from_settings(FAST, until_empty=True)
    Relay(
        Stores(alias).relay(), broker.publisher, config, observers=(), gate=gate
    ).run()


def enqueue(alias: str, broker: Broker, *tags: str) -> dict[str, str]:
    made = {}
    for tag in tags:
        task_id = f"{tag}-{uuid.uuid4().hex[:8]}"
        made[tag] = envelope(
            tag,
            task_id=task_id,
            task_name="shop.call_partner",
            routing_key=broker.queue,
            declare=(broker.queue,),
            queue=broker.queue,
            headers={"id": task_id, "task": "shop.call_partner", KEY_HEADER: "t-1"},
        )
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(list(made.values()))
    return {tag: e.task_id for tag, e in made.items()}


def parked(alias: str) -> int:
    return OutboxMessage.objects.using(alias).filter(state=PARKED).count()


def queued(alias: str) -> int:
    (stats,) = Stores(alias).flows().flow_stats([PARTNER])
    return stats.queued


def test_a_task_waiting_past_the_lease_keeps_its_slot_until_the_broker_loses_it(
    alias: str, broker: Broker
) -> None:
    ids = enqueue(alias, broker, "a1", "a2")
    relay_once(alias, broker)
    assert (broker.waiting(), parked(alias), queued(alias)) == (1, 1, 1)

    # a1 waits in the queue past its lease: a2 still waits for it.
    time.sleep(LEASE + 0.2)
    relay_once(alias, broker)
    assert (broker.waiting(), parked(alias), queued(alias)) == (1, 1, 1)

    # The broker loses a1 (a purge, a Redis without persistence restarted): no
    # worker will start it. At its next lease its slot frees and a2 goes.
    broker.lose_everything()
    time.sleep(LEASE + 0.2)
    relay_once(alias, broker)
    assert broker.task_ids() == [ids["a2"]]
    assert (parked(alias), queued(alias)) == (0, 1)


@pytest.fixture
def rabbitmq() -> Iterator[Broker]:
    made = BROKERS["rabbitmq"]()
    try:
        yield made
    finally:
        made.close()


def test_a_broker_that_cannot_be_asked_keeps_the_slot_another_lease(
    alias: str, rabbitmq: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    broker = rabbitmq
    enqueue(alias, broker, "a1", "a2")
    relay_once(alias, broker)
    time.sleep(LEASE + 0.2)

    def unreachable(queues: Any) -> dict[str, int]:
        raise ConnectionRefusedError("the broker is down")

    gate = FlowGate([PARTNER], Stores(alias).flows(), depth=unreachable)
    config = RelayConfig.from_settings(FAST, until_empty=True)
    Relay(
        Stores(alias).relay(), broker.publisher, config, observers=(), gate=gate
    ).run()
    assert (broker.waiting(), parked(alias), queued(alias)) == (1, 1, 1)
    assert "cannot count the messages in queues" in caplog.text
