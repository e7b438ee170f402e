"""A message whose send makes RabbitMQ close the connection stalls nothing.

A header larger than the broker's ``frame_max`` is refused at the call by current
versions; rows written before that (or for a broker with a smaller limit) reach the
relay anyway. RabbitMQ then closes the whole connection (``frame_too_large``): the
relay must find the row, dead-letter it with the broker's reason, and deliver the
rows around it without sending them again cycle after cycle.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator

import pytest
from django.db import transaction
from kombu import Connection, Queue

from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.envelope import Envelope
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import Stores

from ..conftest import BROKER_AMQP
from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ALIAS = "default"
BEFORE = 5
AFTER = 5
CYCLES = 12

SETTINGS = OutboxSettings(
    max_attempts=2,
    retry_base_seconds=0.001,
    retry_max_seconds=0.002,
    broker_outage_cooldown=0.0,  # every row is due again at once: the worst case
    poll_interval=0.05,
    send_timeout=10.0,
)


@pytest.fixture
def queue_name() -> Iterator[str]:
    name = f"outbox-poison-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        channel.queue_delete(name)
        channel.close()


def write_rows(queue: str) -> tuple[list[str], str]:
    """Good rows, one with a 200 KB header, good rows: written by the store directly."""

    def good(tag: str) -> Envelope:
        return envelope(tag, routing_key=queue, declare=(queue,), queue=queue)

    goods = [good(f"before-{i}") for i in range(BEFORE)]
    poison = envelope(
        "poison",
        routing_key=queue,
        declare=(queue,),
        queue=queue,
        headers={"id": "poison", "task": "shop.record", "big": "x" * 200_000},
    )
    goods_after = [good(f"after-{i}") for i in range(AFTER)]
    with transaction.atomic(using=ALIAS):
        Stores(ALIAS).writer().insert([*goods, poison, *goods_after])
    return [e.task_id for e in [*goods, *goods_after]], poison.task_id


def deliveries(queue: str) -> collections.Counter[str]:
    """How many times each task id sits in ``queue`` (drained)."""
    counts: collections.Counter[str] = collections.Counter()
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        while True:
            message = channel.basic_get(queue, no_ack=True)
            if message is None:
                break
            counts[message.headers["id"]] += 1
        channel.close()
    return counts


def run_relay(confirm: bool) -> None:
    publisher = AmqpPublisher(
        lambda: Connection(BROKER_AMQP, connect_timeout=5),
        lambda name: Queue(name, routing_key=name),
        confirm=confirm,
    )
    config = RelayConfig.from_settings(SETTINGS, breaker_threshold=1000)
    relay = Relay(Stores(ALIAS).relay(), publisher, config, observers=())
    try:
        for _ in range(CYCLES):
            relay.run_once()
    finally:
        publisher.close()


@pytest.mark.parametrize("confirm", [True, False], ids=["confirms", "no-confirms"])
def test_a_message_that_kills_the_connection_is_dead_lettered_alone(
    queue_name: str, confirm: bool
) -> None:
    good_ids, poison_id = write_rows(queue_name)
    run_relay(confirm)

    assert OutboxMessage.objects.using(ALIAS).count() == 0
    dead = DeadLetter.objects.using(ALIAS).get()
    assert dead.task_id == poison_id
    assert "frame_too_large" in dead.last_error
    assert "no other message in flight" in dead.last_error

    counts = deliveries(queue_name)
    assert poison_id not in counts
    # Nothing is lost, confirms or not: every good row arrived.
    assert set(counts) == set(good_ids)
    # The bound: the connection broke once with the whole batch in flight, so a
    # row before the poison may arrive twice (delivered then, never confirmed,
    # sent again alone); never once per cycle, although the relay ran many cycles.
    # The broker read nothing after the poison frame: those rows arrive once.
    assert all(counts[task_id] <= 2 for task_id in good_ids[:BEFORE])
    assert all(counts[task_id] == 1 for task_id in good_ids[BEFORE:])
