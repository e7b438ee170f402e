"""Connection problems that are no message's fault: real brokers, the real relay loop.

Wrong credentials, a user refused the virtual host or a permission, a Redis ACL:
every cycle is an outage. No attempt is used, nothing is dead-lettered (even with
``max_attempts=1``), the log names the reason, and once the credentials are right
every row goes out.
"""

from __future__ import annotations

import logging
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import redis
from django.db import transaction
from kombu import Connection, Queue

from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.broker.base import Publisher
from celery_outbox.broker.redis import RedisPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import Stores

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ALIAS = "default"
ROWS = 5

#: One attempt: a single charged failure would dead-letter the row at once.
STRICT = OutboxSettings(
    max_attempts=1,
    broker_outage_cooldown=0.0,
    poll_interval=0.05,
    send_timeout=10.0,
)


def rabbitmqctl(*args: str) -> None:
    subprocess.run(
        ["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60
    )


@pytest.fixture
def rabbit_user() -> Iterator[str]:
    """A RabbitMQ user of this test alone (password ``right``), deleted afterwards."""
    name = f"outbox-test-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_user", name, "right")
    try:
        yield name
    finally:
        rabbitmqctl("delete_user", name)


@pytest.fixture
def vhost() -> Iterator[str]:
    """A virtual host of this test alone, deleted afterwards."""
    name = f"outbox-test-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@pytest.fixture
def queue_name() -> Iterator[str]:
    name = f"outbox-outage-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        channel.queue_delete(name)
        channel.close()


@pytest.fixture
def redis_user() -> Iterator[str]:
    """A Redis ACL user of this test alone (password ``right``), deleted afterwards."""
    name = f"outbox-test-{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(BROKER_REDIS)
    client.acl_setuser(
        name,
        enabled=True,
        passwords=["+right"],
        keys=["*"],
        channels=["*"],
        commands=["+@all"],
    )
    try:
        yield name
    finally:
        client.acl_deluser(name)
        client.close()


def amqp_publisher(url: str) -> AmqpPublisher:
    return AmqpPublisher(
        lambda: Connection(url, connect_timeout=5),
        lambda name: Queue(name, routing_key=name),
    )


def redis_publisher(url: str, queue: str) -> RedisPublisher:
    return RedisPublisher(
        lambda: Connection(url, connect_timeout=5),
        lambda name: Queue(name, routing_key=name),
    )


def enqueue(queue: str) -> None:
    with transaction.atomic(using=ALIAS):
        Stores(ALIAS).writer().insert(
            [
                envelope(f"o{i}", routing_key=queue, declare=(queue,), queue=queue)
                for i in range(ROWS)
            ]
        )


def assert_outage_charges_nothing(
    publisher: Publisher, reason: str, caplog: pytest.LogCaptureFixture
) -> Relay:
    """Three cycles against ``publisher``: every row waits, unharmed, and why is logged."""
    config = RelayConfig.from_settings(STRICT, breaker_threshold=100)
    relay = Relay(Stores(ALIAS).relay(), publisher, config, observers=())
    with caplog.at_level(logging.WARNING, logger="celery_outbox"):
        for _ in range(3):
            relay.run_once()
    rows = list(
        OutboxMessage.objects.using(ALIAS).values_list(
            "attempts", "lease_token", "last_error"
        )
    )
    assert len(rows) == ROWS
    assert {(attempts, token) for attempts, token, _ in rows} == {(0, None)}
    assert all(reason in error for _, _, error in rows), rows[0]
    assert DeadLetter.objects.using(ALIAS).count() == 0
    assert any(
        "no attempt used" in r.getMessage() and reason in r.getMessage()
        for r in caplog.records
    )
    publisher.close()
    return relay


def publish_all(relay: Relay, publisher: Publisher) -> None:
    relay.publisher = publisher
    for _ in range(3):
        relay.run_once()
    publisher.close()
    assert OutboxMessage.objects.using(ALIAS).count() == 0
    assert DeadLetter.objects.using(ALIAS).count() == 0


def amqp_queued(queue: str) -> int:
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        _, count, _ = channel.queue_declare(queue, passive=True)
        channel.close()
        return int(count)


def test_a_wrong_rabbitmq_password_is_an_outage(
    rabbit_user: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    rabbitmqctl("set_permissions", "-p", "/", rabbit_user, ".*", ".*", ".*")
    enqueue(queue_name)
    relay = assert_outage_charges_nothing(
        amqp_publisher(f"amqp://{rabbit_user}:wrong@127.0.0.1:5672//"),
        "refused the credentials",
        caplog,
    )
    publish_all(relay, amqp_publisher(f"amqp://{rabbit_user}:right@127.0.0.1:5672//"))
    assert amqp_queued(queue_name) == ROWS


def test_a_user_refused_the_virtual_host_is_an_outage(
    rabbit_user: str, vhost: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = f"outbox-outage-{uuid.uuid4().hex[:10]}"
    url = f"amqp://{rabbit_user}:right@127.0.0.1:5672/{vhost}"
    enqueue(queue)
    relay = assert_outage_charges_nothing(
        amqp_publisher(url), "refused access to the virtual host", caplog
    )
    rabbitmqctl("set_permissions", "-p", vhost, rabbit_user, ".*", ".*", ".*")
    publish_all(relay, amqp_publisher(url))
    with Connection(url) as conn:
        channel = conn.channel()
        assert channel.queue_declare(queue, passive=True)[1] == ROWS
        channel.close()


def test_a_user_without_write_permission_is_an_outage(
    rabbit_user: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # May use the virtual host, but neither declare nor publish anything.
    rabbitmqctl("set_permissions", "-p", "/", rabbit_user, "", "", "")
    url = f"amqp://{rabbit_user}:right@127.0.0.1:5672//"
    enqueue(queue_name)
    relay = assert_outage_charges_nothing(
        amqp_publisher(url), "refused the credentials or a permission", caplog
    )
    rabbitmqctl("set_permissions", "-p", "/", rabbit_user, ".*", ".*", ".*")
    publish_all(relay, amqp_publisher(url))
    assert amqp_queued(queue_name) == ROWS


def redis_url(user: str, password: str) -> str:
    return BROKER_REDIS.replace("redis://", f"redis://{user}:{password}@")


@pytest.fixture
def redis_queue() -> Iterator[str]:
    name = f"outbox-outage-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(BROKER_REDIS)
    client.delete(name)
    client.close()


def redis_length(queue: str) -> int:
    client = redis.Redis.from_url(BROKER_REDIS)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def test_a_wrong_redis_acl_password_is_an_outage(
    redis_user: str, redis_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(redis_queue)
    relay = assert_outage_charges_nothing(
        redis_publisher(redis_url(redis_user, "wrong"), redis_queue),
        "Redis refused the credentials",
        caplog,
    )
    publish_all(relay, redis_publisher(redis_url(redis_user, "right"), redis_queue))
    assert redis_length(redis_queue) == ROWS


def test_a_redis_acl_without_lpush_is_an_outage(
    redis_user: str, redis_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(BROKER_REDIS)

    def allow(rule: str) -> None:
        client.acl_setuser(redis_user, enabled=True, commands=[rule])

    allow("-lpush")
    enqueue(redis_queue)
    try:
        relay = assert_outage_charges_nothing(
            redis_publisher(redis_url(redis_user, "right"), redis_queue),
            "lacks a permission",
            caplog,
        )
        allow("+lpush")
        publish_all(relay, redis_publisher(redis_url(redis_user, "right"), redis_queue))
    finally:
        client.close()
    assert redis_length(redis_queue) == ROWS
