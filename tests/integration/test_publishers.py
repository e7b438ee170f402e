"""Publishers against the real brokers: confirms, refusals, outages."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_outbox.broker import FixedBudget
from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.broker.amqpcodec import amqp_problem
from celery_outbox.broker.kombu import KombuPublisher
from celery_outbox.broker.redis import RedisPublisher
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Outcome

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


@pytest.mark.parametrize("with_id", [True, False], ids=["same task id", "no id header"])
def test_amqp_returned_message_is_told_from_its_namesake(
    queue_name: str, with_id: bool
) -> None:
    # Two rows that look alike to a header lookup: the first goes to a durable queue,
    # so its confirm waits for the disk, while the second is returned at once.
    exchange = f"outbox-x-{uuid.uuid4().hex[:8]}"
    task_id = f"twin-{uuid.uuid4().hex[:8]}"
    headers = {"id": task_id, "task": "shop.record"} if with_id else {"task": "t"}
    with Connection(BROKER_AMQP) as conn:
        Exchange(exchange, "direct", durable=False, auto_delete=True)(
            conn.channel()
        ).declare()
        for _ in range(5):
            routed = StoredMessage(
                1,
                0,
                envelope(
                    "routed",
                    task_id=task_id,
                    headers=headers,
                    routing_key=queue_name,
                    declare=(queue_name,),
                    queue=queue_name,
                ),
            )
            lost = StoredMessage(
                2,
                0,
                envelope(
                    "lost",
                    task_id=task_id,
                    headers=headers,
                    exchange=exchange,
                    routing_key="nowhere",
                    declare=(),
                ),
            )
            publisher = amqp_publisher()
            results = publisher.publish(
                [routed, lost], FixedBudget(time.monotonic() + 10)
            )
            publisher.close()
            outcomes = {r.message_id: r.outcome for r in results}
            assert outcomes == {1: Outcome.PUBLISHED, 2: Outcome.FAILED}
    assert queued(queue_name) == 5


def test_amqp_outage_after_a_failed_batch_is_an_outage(queue_name: str) -> None:
    # A refused batch, then the broker goes away: the next batch must not be answered
    # with the results the refused one left behind (each would use up an attempt).
    url = [BROKER_AMQP]
    publisher = AmqpPublisher(
        lambda: Connection(url[0], connect_timeout=2),
        lambda name: Queue(name, routing_key=name),
    )
    refused = StoredMessage(
        7, 0, envelope("x", exchange=f"missing-{uuid.uuid4().hex}", declare=())
    )
    first = publisher.publish([refused], FixedBudget(time.monotonic() + 5))
    assert [r.outcome for r in first] == [Outcome.FAILED]
    publisher.close()
    url[0] = DEAD_PORT
    for _ in range(2):
        again = publisher.publish([refused], FixedBudget(time.monotonic() + 5))
        assert [r.outcome for r in again] == [Outcome.OUTAGE]


@pytest.mark.parametrize(
    ("label", "overrides"),
    [
        ("header integer of 2**70", {"headers": {"id": "big", "n": 2**70}}),
        ("header name over 255 bytes", {"headers": {"id": "long", "k" * 300: 1}}),
        ("priority that is no number", {"properties": {"priority": "high"}}),
        ("routing key over 255 bytes", {"routing_key": "é" * 200}),
    ],
)
def test_amqp_message_that_cannot_be_encoded_fails_alone(
    queue_name: str, label: str, overrides: dict[str, Any]
) -> None:
    good = stored(queue_name, 4)
    bad = StoredMessage(60, 0, envelope("bad", declare=(), **overrides))
    publisher = amqp_publisher()
    results = publisher.publish(
        [good[0], good[1], bad, good[2]], FixedBudget(time.monotonic() + 10)
    )
    # The channel keeps counting delivery tags right: the next batch is confirmed.
    later = publisher.publish([good[3]], FixedBudget(time.monotonic() + 10))
    publisher.close()
    outcome = {r.message_id: r for r in results}
    assert outcome[60].outcome is Outcome.FAILED, label
    assert "cannot be encoded" in outcome[60].error
    # The enqueue path's check agrees with the relay's encoder, both ways.
    assert amqp_problem(bad.envelope) is not None
    assert [amqp_problem(m.envelope) for m in good] == [None] * 4
    assert [outcome[m.id].outcome for m in good[:3]] == [Outcome.PUBLISHED] * 3
    assert [r.outcome for r in later] == [Outcome.PUBLISHED]
    assert queued(queue_name) == 4


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


def test_redis_a_list_that_refuses_a_push_fails_only_its_message(
    redis_queue: str,
) -> None:
    # The pipeline runs every push even when one fails: the others are in their
    # list once, and must not be sent again.
    blocked = f"{redis_queue}-blocked"
    client = redis.Redis.from_url(BROKER_REDIS)
    publisher = RedisPublisher(
        lambda: Connection(BROKER_REDIS), lambda name: Queue(name, routing_key=name)
    )
    try:
        publisher.publish(
            stored(blocked, 1), FixedBudget(time.monotonic() + 10)
        )  # declares and binds the queue
        client.delete(blocked)
        client.set(blocked, "not a list")  # WRONGTYPE for an LPUSH
        good = stored(redis_queue, 3)
        bad = StoredMessage(
            70,
            0,
            envelope("bad", routing_key=blocked, declare=(blocked,), queue=blocked),
        )
        results = publisher.publish(
            [good[0], bad, good[1], good[2]], FixedBudget(time.monotonic() + 10)
        )
    finally:
        publisher.close()
        client.delete(blocked)
    outcome = {r.message_id: r for r in results}
    assert outcome[70].outcome is Outcome.FAILED
    assert "WRONGTYPE" in outcome[70].error
    assert [outcome[m.id].outcome for m in good] == [Outcome.PUBLISHED] * 3
    assert client.llen(redis_queue) == 3


def test_amqp_without_confirms_a_batch_whose_frames_never_left_is_not_published(
    queue_name: str,
) -> None:
    publisher = AmqpPublisher(
        lambda: Connection(BROKER_AMQP, connect_timeout=2),
        lambda name: Queue(name, routing_key=name),
        confirm=False,
    )
    publisher.ping()
    messages = stored(queue_name, 5)
    publisher.publish(messages[:1], FixedBudget(time.monotonic() + 10))  # declares

    class SocketDiesAtTheEnd(FixedBudget):
        """The connection breaks after the last message was encoded, before it is sent."""

        started = 0

        def keep_going(self) -> bool:
            self.started += 1
            return True

        def deadline(self) -> float:
            if self.started == len(messages):  # asked when the held frames go out
                self.started += 1
                sock = publisher._connection.connection.transport.sock
                sock.shutdown(socket.SHUT_RDWR)
            return super().deadline()

    try:
        results = publisher.publish(messages, SocketDiesAtTheEnd(time.monotonic() + 10))
    finally:
        publisher.close()
    # The batch's frames were held and never written: none of it may count as sent.
    assert Outcome.PUBLISHED not in {r.outcome for r in results}
    assert queued(queue_name) == 1  # the first publish only
