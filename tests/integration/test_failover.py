"""A broker named by a failover list: the relay's publishers, ``outbox health`` and
``outbox events`` go to the next node as kombu does, at start and after a node dies.

Real RabbitMQ and Redis. A node that is down is a closed port of this test
(``tests/proxy.closed_port``); a node that dies is a TCP proxy in front of the
shared server that the test cuts (``tests/proxy.Proxy``): the servers themselves are
never stopped. The relay process itself is tested in ``tests/e2e/test_failover.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import amqp.exceptions
import pytest
import redis
from celery import Celery
from django.core.management import CommandError, call_command
from kombu import Connection, Queue

from celery_outbox.broker import Publisher, build_publisher
from celery_outbox.broker.base import FixedBudget
from celery_outbox.broker.failover import NoNodeAnswered
from celery_outbox.conf import OutboxSettings
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Outcome
from tests.proxy import Proxy, closed_port

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .builders import envelope

_ids = iter(range(5000, 10**9, 3))


@dataclass(frozen=True)
class Server:
    """One shared broker: how to name a node of it, and what reached a queue."""

    scheme: str
    port: int
    url: str

    def node(self, port: int) -> str:
        """The URL of a node of this broker at ``127.0.0.1:port``."""
        if self.scheme == "amqp":
            return f"amqp://guest:guest@127.0.0.1:{port}//"
        return f"redis://127.0.0.1:{port}/14"

    def arrived(self, queue: str) -> list[str]:
        """Task ids in ``queue``, in the order a worker takes them (taken off)."""
        if self.scheme == "redis":
            client = redis.Redis.from_url(self.url)
            try:
                entries = client.lrange(queue, 0, -1)
                client.delete(queue)
            finally:
                client.close()
            return [json.loads(e)["headers"]["id"] for e in reversed(entries)]
        taken = []
        with Connection(self.url) as connection:
            channel = connection.channel()
            try:
                while (message := channel.basic_get(queue, no_ack=True)) is not None:
                    taken.append(message.headers["id"])
                channel.queue_delete(queue)
            except amqp.exceptions.NotFound:
                pass  # never declared, or taken already
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
        return taken


SERVERS = {
    "rabbitmq": Server("amqp", 5672, BROKER_AMQP),
    "redis": Server("redis", 6379, BROKER_REDIS),
}


@pytest.fixture(params=list(SERVERS))
def server(request: pytest.FixtureRequest) -> Server:
    return SERVERS[request.param]


@pytest.fixture
def queue(server: Server) -> Iterator[str]:
    name = f"outbox-failover-{uuid.uuid4().hex[:10]}"
    yield name
    server.arrived(name)  # and removed


@pytest.fixture
def down_port() -> Iterator[int]:
    """A port of 127.0.0.1 where nothing listens, for the test's whole length."""
    with closed_port() as sock:
        yield sock.getsockname()[1]


def publisher_for(url: str, queue: str) -> Publisher:
    """The relay's publisher for an app whose broker_url is ``url``."""
    app = Celery("failover", broker=url, set_as_current=False)
    app.conf.task_queues = [Queue(queue, routing_key=queue)]
    return build_publisher(app, OutboxSettings(send_timeout=5.0))


def batch(queue: str, count: int) -> list[StoredMessage]:
    return [
        StoredMessage(
            next(_ids),
            0,
            envelope(f"f{n}", routing_key=queue, declare=(queue,), queue=queue),
        )
        for n in range(count)
    ]


def publish(publisher: Publisher, messages: list[StoredMessage]) -> list[Outcome]:
    results = publisher.publish(messages, FixedBudget(time.monotonic() + 30))
    assert [r.message_id for r in results] == [m.id for m in messages]
    return [r.outcome for r in results]


def task_ids(messages: list[StoredMessage]) -> list[str]:
    return [m.envelope.task_id for m in messages]


def test_the_first_node_down_at_start_the_relay_publishes_on_the_next(
    server: Server, queue: str, down_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{server.node(down_port)};{server.node(server.port)}"
    publisher = publisher_for(url, queue)
    messages = batch(queue, 5)
    try:
        with caplog.at_level(logging.INFO, logger="celery_outbox.broker"):
            assert publisher.ping() == Connection(server.node(server.port)).as_uri()
            assert publish(publisher, messages) == [Outcome.PUBLISHED] * 5
    finally:
        publisher.close()
    assert server.arrived(queue) == task_ids(messages)
    lines = [r.getMessage() for r in caplog.records]
    assert any(f":{down_port}/" in line and "did not answer" in line for line in lines)
    assert any(
        line.startswith(f"broker node {Connection(server.node(server.port)).as_uri()}")
        and "connected" in line
        for line in lines
    ), lines


def test_a_node_that_dies_under_the_relay_the_rest_goes_to_the_next_node(
    server: Server, queue: str
) -> None:
    """No outage while another node is up: the batch in hand goes out at once."""
    with Proxy("127.0.0.1", server.port) as node_a:
        url = f"{server.node(node_a.port)};{server.node(server.port)}"
        publisher = publisher_for(url, queue)
        first, second = batch(queue, 4), batch(queue, 6)
        try:
            assert publish(publisher, first) == [Outcome.PUBLISHED] * 4
            assert node_a.accepted >= 1  # on node a
            node_a.cut()
            assert publish(publisher, second) == [Outcome.PUBLISHED] * 6
            assert publisher.ping() == Connection(server.node(server.port)).as_uri()
        finally:
            publisher.close()
    assert server.arrived(queue) == task_ids(first) + task_ids(second)


def test_a_cluster_with_no_node_up_is_an_outage_naming_every_node(
    server: Server, queue: str
) -> None:
    with closed_port() as a, closed_port() as b:
        ports = [a.getsockname()[1], b.getsockname()[1]]
        publisher = publisher_for(";".join(server.node(p) for p in ports), queue)
        messages = batch(queue, 3)
        try:
            results = publisher.publish(messages, FixedBudget(time.monotonic() + 30))
            with pytest.raises(NoNodeAnswered) as raised:
                publisher.ping()
        finally:
            publisher.close()
    assert [r.outcome for r in results] == [Outcome.OUTAGE] * 3
    for text in (results[0].error, str(raised.value)):
        assert "no node of the broker's failover list answered" in text
        assert all(f"127.0.0.1:{port}/" in text for port in ports), text
    assert not any(r.in_flight for r in results)


# -- the commands ----------------------------------------------------------------


@contextlib.contextmanager
def broker_url(app: Any, url: str) -> Iterator[None]:
    """The test project's app talks to ``url`` while the block runs."""
    was = app.conf.broker_url
    app.conf.broker_url = url
    try:
        yield
    finally:
        app.conf.broker_url = was


def command(*args: str) -> str:
    out: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            out.append(text)

        def flush(self) -> None:
            pass

    call_command("outbox", *args, stdout=Out())
    return "".join(out)


@pytest.mark.django_db(transaction=True)
def test_health_says_which_node_answered_and_names_every_node_when_none_did(
    outbox_app: Any, down_port: int
) -> None:
    amqp = SERVERS["rabbitmq"]
    good = amqp.node(amqp.port)
    with broker_url(outbox_app, f"{amqp.node(down_port)};{good}"):
        line = command("health")
    assert f"broker node {Connection(good).as_uri()} (of " in line
    assert f":{down_port}//" in line
    with closed_port() as other:
        other_port = other.getsockname()[1]
        with (
            broker_url(outbox_app, f"{amqp.node(down_port)};{amqp.node(other_port)}"),
            pytest.raises(CommandError) as raised,
        ):
            command("health")
    text = str(raised.value)
    assert "no node of the broker's failover list answered" in text
    assert f":{down_port}//" in text and f":{other_port}//" in text


@pytest.fixture
def events_app(outbox_app: Any) -> Iterator[Callable[[str], Any]]:
    """``outbox events --service S declare`` on an exchange of this test, removed after."""
    from django.test import override_settings

    from .test_events import delete_topology

    name = f"test-failover-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=name, CELERY_OUTBOX_EVENTS_MAX_RETRIES=1
    ):
        yield lambda verb: command("events", "--service", "billing", verb)
    delete_topology(name, ["billing"], 1, ())


@pytest.mark.django_db(transaction=True)
def test_events_declare_goes_to_the_next_node_and_says_which(
    outbox_app: Any, events_app: Callable[[str], str], down_port: int
) -> None:
    amqp = SERVERS["rabbitmq"]
    good = amqp.node(amqp.port)
    with broker_url(outbox_app, f"{amqp.node(down_port)};{good}"):
        line = events_app("declare")
    assert line.startswith("declared ")
    assert line.rstrip().endswith(f"on {Connection(good).as_uri()}")
