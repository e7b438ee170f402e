"""Where production runs: quorum queues, Redis behind Sentinel, Redis and RabbitMQ
over TLS. In each, a real relay (``build_relay``, as ``manage.py outbox relay``
builds it) publishes committed tasks and a consumer on the same broker receives
every one, once, intact; nothing is left in the outbox and nothing is dead-lettered.

The servers are the test's own (``tests/topologies.py``), on free loopback ports,
with a certificate authority made for the run; the quorum queue is a queue of this
run's on the shared RabbitMQ, deleted afterwards. A certificate the relay cannot
verify is an outage: the rows wait, no attempt is used.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import Celery
from django.db import transaction
from kombu import Connection
from packaging.version import Version

from celery_outbox import OutboxCelery
from celery_outbox.broker import build_publisher
from celery_outbox.cli.runner import build_relay
from celery_outbox.conf import get_settings
from celery_outbox.engine.loop import Turn
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.relay.observations import StopReason
from tests import topologies
from tests.conftest import BROKER_AMQP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

#: Tasks per topology: several relay batches, a second's work.
TASKS = 120
#: How long the consumer waits for the last message.
RECEIVE_TIMEOUT = 30.0


@pytest.fixture
def queue() -> str:
    """A queue name of this test's alone."""
    return f"outbox-topology-{uuid.uuid4().hex[:10]}"


def broker_app(url: str, queue: str, **conf: Any) -> OutboxCelery:
    """The app of a project on this broker, its default queue ``queue``: it writes the
    rows (in the test database), the relay publishes with it and the consumer reads
    with it, as one project's settings would have it."""
    app = OutboxCelery("topology", set_as_current=False)
    app.conf.update(
        broker_url=url, task_default_queue=queue, broker_connection_timeout=5, **conf
    )
    return app


def enqueue(app: OutboxCelery, count: int = TASKS) -> dict[str, str]:
    """Commit ``count`` tasks to the app's default queue: their task ids and tags."""
    queue = app.conf.task_default_queue
    sent = {}
    with transaction.atomic():
        for n in range(count):
            tag = f"{queue}-{n}"
            sent[app.send_task("shop.record", (tag,)).id] = tag
    return sent


def relay(app: Celery) -> Any:
    """The relay ``manage.py outbox relay --until-empty`` runs, publishing to ``app``'s broker."""
    settings = get_settings()
    return build_relay(
        settings, publisher=build_publisher(app, settings), until_empty=True
    )


def receive(app: Celery, queue: str, count: int) -> Counter[tuple[str, str]]:
    """Consume ``queue`` until ``count`` messages came (and a moment more, for a
    duplicate); each as (task id, the tag in its arguments)."""
    got: Counter[tuple[str, str]] = Counter()
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(app.amqp.queues[queue], accept=["json"])
        try:
            deadline = time.monotonic() + RECEIVE_TIMEOUT
            while time.monotonic() < deadline:
                try:
                    message = simple.get(timeout=0.5)
                except simple.Empty:
                    if sum(got.values()) >= count:
                        break
                    continue
                args, _kwargs, _embed = message.decode()
                got[(message.headers["id"], args[0])] += 1
                message.ack()
        finally:
            simple.close()
    return got


def deliver_through(app: Celery, queue: str) -> None:
    """The relay publishes committed tasks; every one arrives once, intact."""
    sent = enqueue(app)
    started = time.monotonic()
    assert relay(app).run() is StopReason.EMPTY
    published_in = time.monotonic() - started
    got = receive(app, queue, len(sent))
    assert got == Counter(sent.items()), (
        f"lost {set(sent.items()) - set(got)}, "
        f"twice {[k for k, n in got.items() if n > 1]}"
    )
    assert OutboxMessage.objects.count() == 0
    assert DeadLetter.objects.count() == 0
    print(f"{len(sent)} tasks published in {published_in:.2f} s")


def assert_an_unverified_certificate_is_an_outage(app: Celery, queue: str) -> None:
    """A broker whose certificate the relay cannot verify: the rows wait, no attempt used."""
    enqueue(app, 3)
    once = relay(app)
    try:
        assert once.run_once() is Turn.PARTIAL  # claimed, then put back
    finally:
        once.publisher.close()
    rows = list(OutboxMessage.objects.values_list("attempts", "last_error"))
    assert len(rows) == 3
    assert all(attempts == 0 for attempts, _ in rows), rows
    assert all("certificate" in str(error).lower() for _, error in rows), rows
    assert DeadLetter.objects.count() == 0


# -- quorum queues on the shared RabbitMQ ------------------------------------------


@pytest.fixture
def quorum_queue(queue: str) -> Iterator[str]:
    yield queue
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        channel = connection.channel()
        try:
            channel.queue_delete(queue)
            channel.exchange_delete(queue)
        finally:
            channel.close()


@pytest.mark.skipif(
    Version(celery.__version__) < Version("5.5"),
    reason="task_default_queue_type arrived in Celery 5.5",
)
def test_quorum_queues_with_publisher_confirms(quorum_queue: str) -> None:
    app = broker_app(BROKER_AMQP, quorum_queue, task_default_queue_type="quorum")
    assert get_settings().confirm_publish  # the relay waits for the broker's confirms
    deliver_through(app, quorum_queue)
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        # The relay declared the queue as the app says: a quorum queue (the
        # declaration of a classic one of that name would fail here).
        channel = connection.channel()
        try:
            channel.queue_declare(
                quorum_queue,
                durable=True,
                auto_delete=False,
                arguments={"x-queue-type": "quorum"},
                passive=False,
            )
        finally:
            channel.close()


# -- Redis behind Sentinel ----------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[topologies.Sentinel]:
    folder = tmp_path_factory.mktemp("sentinel")
    with (
        topologies.redis_server(folder / "master") as master,
        topologies.redis_sentinel(
            folder / "sentinel", master, "outbox-master"
        ) as found,
    ):
        print(
            f"redis master started in {master.process.started_in:.2f} s, "
            f"sentinel in {found.process.started_in:.2f} s"
        )
        yield found


def test_redis_behind_sentinel(sentinel: topologies.Sentinel, queue: str) -> None:
    app = broker_app(
        sentinel.url,
        queue,
        broker_transport_options={"master_name": sentinel.master_name},
    )
    deliver_through(app, queue)


def test_a_sentinel_failover_loses_nothing(
    tmp_path: Path, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The primary refuses writes without a replica (min-replicas-to-write, as Redis
    # advises behind Sentinel): once its replica is promoted, the relay still
    # connected to it is refused instead of writing where no consumer reads, and
    # reconnects to the primary Sentinel names.
    with (
        topologies.redis_server(
            tmp_path / "a", options=["--min-replicas-to-write", "1"]
        ) as primary,
        topologies.redis_server(tmp_path / "b", replica_of=primary) as replica,
        topologies.redis_sentinel(
            tmp_path / "s", primary, "outbox-failover", [replica]
        ) as found,
    ):
        app = broker_app(
            found.url,
            queue,
            broker_transport_options={"master_name": found.master_name},
        )
        settings = get_settings()
        running = build_relay(
            settings,
            publisher=build_publisher(app, settings),
            broker_outage_cooldown=0.1,
        )
        try:
            sent = enqueue(app, TASKS // 2)
            drain(running)
            wait_for_replication(primary, replica, queue, len(sent))
            promoted_in = found.fail_over_to(replica)
            with caplog.at_level(logging.WARNING, logger="celery_outbox.relay"):
                later = enqueue(app, TASKS // 2)
                drain(running)
        finally:
            running.publisher.close()
        got = receive(app, queue, len(sent) + len(later))
    assert got == Counter({**sent, **later}.items())
    assert DeadLetter.objects.count() == 0
    lines = [r.getMessage() for r in caplog.records]
    met = [
        x
        for x in lines
        if x.startswith("broker outage")
        and "fewer replicas than its min-replicas-to-write" in x
    ]
    # The relay met the old primary once, used no attempt on it, and reconnected
    # to the primary Sentinel names.
    assert len(met) == 1, lines
    assert not any("refused by the broker" in x for x in lines), lines
    print(f"Sentinel promoted the replica in {promoted_in:.2f} s")


def drain(running: Any, timeout: float = 30.0) -> None:
    """Turn the relay until the outbox is empty (outages put rows back meanwhile)."""
    deadline = time.monotonic() + timeout
    while OutboxMessage.objects.exists():
        assert time.monotonic() < deadline, "the outbox did not empty"
        if running.run_once() is Turn.PAUSED:
            time.sleep(0.05)


def wait_for_replication(
    primary: topologies.Redis, replica: topologies.Redis, queue: str, count: int
) -> None:
    import redis

    with redis.Redis(port=replica.port) as client:
        deadline = time.monotonic() + 10
        while client.llen(queue) < count:
            assert time.monotonic() < deadline, "the replica did not catch up"
            time.sleep(0.02)


# -- Redis over TLS -------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> topologies.Certificates:
    return topologies.make_certificates(tmp_path_factory.mktemp("certificates"))


@pytest.fixture(scope="module")
def redis_tls(
    tmp_path_factory: pytest.TempPathFactory, certificates: topologies.Certificates
) -> Iterator[topologies.Redis]:
    with topologies.redis_server(
        tmp_path_factory.mktemp("redis-tls"), tls=certificates
    ) as server:
        print(f"redis over TLS started in {server.process.started_in:.2f} s")
        yield server


def test_redis_over_tls(redis_tls: topologies.Redis, queue: str) -> None:
    assert redis_tls.url.startswith("rediss://")
    app = broker_app(
        redis_tls.url, queue, broker_use_ssl=topologies.redis_tls(redis_tls.tls)
    )
    deliver_through(app, queue)


def test_redis_with_a_certificate_it_cannot_verify(
    redis_tls: topologies.Redis, queue: str, tmp_path: Path
) -> None:
    stranger = topologies.make_certificates(tmp_path)  # another CA: not the server's
    app = broker_app(
        redis_tls.url, queue, broker_use_ssl=topologies.redis_tls(stranger)
    )
    assert_an_unverified_certificate_is_an_outage(app, queue)


# -- RabbitMQ over TLS: a node of the test's own ------------------------------------


@pytest.fixture(scope="module")
def rabbitmq_tls(
    tmp_path_factory: pytest.TempPathFactory, certificates: topologies.Certificates
) -> Iterator[topologies.RabbitNode]:
    with topologies.rabbitmq_tls_node(
        tmp_path_factory.mktemp("rabbitmq-tls"), certificates
    ) as node:
        print(f"RabbitMQ node over TLS started in {node.process.started_in:.2f} s")
        yield node


def test_rabbitmq_over_tls(rabbitmq_tls: topologies.RabbitNode, queue: str) -> None:
    app = broker_app(
        rabbitmq_tls.url, queue, broker_use_ssl=topologies.amqp_tls(rabbitmq_tls.tls)
    )
    deliver_through(app, queue)


def test_rabbitmq_with_a_certificate_it_cannot_verify(
    rabbitmq_tls: topologies.RabbitNode, queue: str, tmp_path: Path
) -> None:
    stranger = topologies.make_certificates(tmp_path)
    app = broker_app(
        rabbitmq_tls.url, queue, broker_use_ssl=topologies.amqp_tls(stranger)
    )
    assert_an_unverified_certificate_is_an_outage(app, queue)
