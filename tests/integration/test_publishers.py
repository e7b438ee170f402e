"""Publishers against the real brokers: confirms, refusals, outages."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_outbox.broker import FixedBudget
from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.broker.kombu import KombuPublisher
from celery_outbox.broker.redis import RedisPublisher
from celery_outbox.envelope import StoredMessage
from celery_outbox.relay.core import Outcome

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .builders import envelope

DEAD_PORT = "amqp://guest:guest@127.0.0.1:1//"


@pytest.fixture
def queue_name() -> Iterator[str]:
    name = f"outbox-pub-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        channel.queue_delete(name)
        channel.close()


def stored(queue: str, count: int, **overrides: Any) -> list[StoredMessage]:
    return [
        StoredMessage(
            i + 1,
            0,
            envelope(
                f"m{i}", routing_key=queue, declare=(queue,), queue=queue, **overrides
            ),
        )
        for i in range(count)
    ]


def amqp_publisher(url: str = BROKER_AMQP) -> AmqpPublisher:
    return AmqpPublisher(
        lambda: Connection(url, connect_timeout=2),
        lambda name: Queue(name, routing_key=name),
    )


def queued(queue: str) -> int:
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        _, count, _ = channel.queue_declare(queue, passive=True)
        channel.close()
        return int(count)


def test_amqp_batch_is_confirmed_and_lands_in_the_queue(queue_name: str) -> None:
    publisher = amqp_publisher()
    messages = stored(queue_name, 120)
    results = publisher.publish(messages, FixedBudget(time.monotonic() + 10))
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * 120
    assert [r.message_id for r in results] == [m.id for m in messages]
    # The same channel serves the next batch (delivery tags keep counting).
    again = publisher.publish(
        stored(queue_name, 30), FixedBudget(time.monotonic() + 10)
    )
    assert {r.outcome for r in again} == {Outcome.PUBLISHED}
    publisher.close()
    assert queued(queue_name) == 150


def test_amqp_unroutable_message_fails_alone(queue_name: str) -> None:
    exchange = f"outbox-x-{uuid.uuid4().hex[:8]}"
    with Connection(BROKER_AMQP) as conn:
        Exchange(exchange, "direct", durable=False, auto_delete=True)(
            conn.channel()
        ).declare()
        good = stored(queue_name, 3)
        lost = StoredMessage(
            99,
            0,
            envelope("lost", exchange=exchange, routing_key="nowhere", declare=()),
        )
        publisher = amqp_publisher()
        results = publisher.publish(
            [good[0], lost, good[1], good[2]], FixedBudget(time.monotonic() + 10)
        )
        publisher.close()
    outcomes = {r.message_id: r for r in results}
    assert outcomes[99].outcome is Outcome.FAILED
    assert "Unroutable" in outcomes[99].error
    assert [outcomes[m.id].outcome for m in good] == [Outcome.PUBLISHED] * 3
    assert queued(queue_name) == 3


def test_amqp_unknown_exchange_fails_alone(queue_name: str) -> None:
    good = stored(queue_name, 2)
    bad = StoredMessage(
        50, 0, envelope("bad", exchange=f"missing-{uuid.uuid4().hex}", declare=())
    )
    publisher = amqp_publisher()
    results = publisher.publish(
        [good[0], bad, good[1]], FixedBudget(time.monotonic() + 10)
    )
    publisher.close()
    outcome = {r.message_id: r for r in results}
    assert outcome[50].outcome is Outcome.FAILED
    assert "NotFound" in outcome[50].error
    assert outcome[good[0].id].outcome is Outcome.PUBLISHED
    assert outcome[good[1].id].outcome is Outcome.PUBLISHED
    assert queued(queue_name) == 2


def test_amqp_unreachable_broker_is_an_outage_not_a_failure() -> None:
    publisher = amqp_publisher(DEAD_PORT)
    started = time.monotonic()
    results = publisher.publish(stored("nowhere", 3), FixedBudget(time.monotonic() + 5))
    assert {r.outcome for r in results} == {Outcome.OUTAGE}
    assert time.monotonic() - started < 5


@pytest.fixture
def redis_queue() -> Iterator[str]:
    name = f"outbox-pub-{uuid.uuid4().hex[:10]}"
    yield name
    redis.Redis.from_url(BROKER_REDIS).delete(name)


def test_redis_batch_is_pipelined_into_the_list(redis_queue: str) -> None:
    publisher = KombuPublisher(
        lambda: Connection(BROKER_REDIS), lambda name: Queue(name, routing_key=name)
    )
    results = publisher.publish(
        stored(redis_queue, 200), FixedBudget(time.monotonic() + 10)
    )
    publisher.close()
    assert {r.outcome for r in results} == {Outcome.PUBLISHED}
    assert redis.Redis.from_url(BROKER_REDIS).llen(redis_queue) == 200


@pytest.mark.parametrize("kind", [KombuPublisher, RedisPublisher])
def test_redis_unreachable_is_an_outage(kind: type[KombuPublisher]) -> None:
    publisher = kind(
        lambda: Connection(
            "redis://127.0.0.1:1/0",
            connect_timeout=1,
            transport_options={"socket_connect_timeout": 1},
        ),
        lambda name: Queue(name),
    )
    results = publisher.publish(stored("nowhere", 2), FixedBudget(time.monotonic() + 5))
    assert {r.outcome for r in results} == {Outcome.OUTAGE}
