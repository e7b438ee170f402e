"""A real relay whose broker URL is a failover list: it publishes on the node that
answers, at start and after the node it was on dies (#39).

Node a is down (a closed port of this test) or is a TCP proxy in front of the shared
RabbitMQ or Redis that the test cuts (``tests/proxy.py``); node b is the shared
server itself. A real Celery worker, on the shared server directly, runs the tasks:
each exactly once, nothing left in the outbox, nothing dead-lettered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from django.db import transaction
from kombu import Connection

from celery_outbox.models import DeadLetter
from tests.e2e.conftest import BROKER_AMQP, BROKER_REDIS, Stack
from tests.e2e.test_delivery import (
    assert_exactly_once,
    new_prefix,
    outbox_rows,
    runs,
    wait_for_empty_outbox,
    wait_for_runs,
)
from tests.project.shop.tasks import record
from tests.proxy import Proxy, closed_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(180),
    pytest.mark.django_db(transaction=True),
]

E2EFactory = Callable[..., Stack]
TASKS = 20

#: Each shared broker: its port, and the URL of a node of it at a given port.
BROKERS = {
    "rabbitmq": (BROKER_AMQP, 5672, "amqp://guest:guest@127.0.0.1:{}//"),
    "redis": (BROKER_REDIS, 6379, "redis://127.0.0.1:{}/14"),
}


@pytest.fixture(params=list(BROKERS))
def broker(request: pytest.FixtureRequest) -> tuple[str, int, str]:
    return BROKERS[request.param]


@pytest.fixture
def down_port() -> Iterator[int]:
    with closed_port() as sock:
        yield sock.getsockname()[1]


def enqueue(prefix: str, start: int = 0) -> set[str]:
    tags = {f"{prefix}-{n}" for n in range(start, start + TASKS)}
    with transaction.atomic():
        for tag in sorted(tags):
            record.delay(tag)
    return tags


def assert_delivered(alias: str, prefix: str, expected: set[str]) -> None:
    wait_for_runs(alias, prefix, expected)
    wait_for_empty_outbox(alias)
    assert_exactly_once(runs(alias, prefix), expected)
    assert DeadLetter.objects.using(alias).count() == 0


def test_the_first_node_down_at_start_the_relay_publishes_on_the_next(
    e2e: E2EFactory, broker: tuple[str, int, str], down_port: int
) -> None:
    direct, port, node = broker
    relay = e2e("postgresql", f"{node.format(down_port)};{node.format(port)}")
    e2e("postgresql", direct).start_worker()
    prefix = new_prefix("failover-start")
    expected = enqueue(prefix)

    code, log = relay.run_relay("--until-empty")
    assert code == 0, log
    assert outbox_rows(relay.alias) == 0, log  # every row published, at once
    assert_delivered(relay.alias, prefix, expected)
    answered = Connection(node.format(port)).as_uri()
    assert f"connected to node {answered}" in log, log


def test_the_node_the_relay_is_on_dies_and_it_goes_on_on_the_next(
    e2e: E2EFactory, broker: tuple[str, int, str]
) -> None:
    direct, port, node = broker
    with Proxy("127.0.0.1", port) as node_a:
        relay = e2e("postgresql", f"{node.format(node_a.port)};{node.format(port)}")
        e2e("postgresql", direct).start_worker()
        proc = relay.start_relay()
        prefix = new_prefix("failover-midrun")
        first = enqueue(prefix)
        assert_delivered(relay.alias, prefix, first)
        assert node_a.accepted >= 1  # the relay was on node a

        node_a.cut()
        second = enqueue(prefix, start=TASKS)
        assert_delivered(relay.alias, prefix, first | second)
        answered = Connection(node.format(port)).as_uri()
        assert f"broker node {answered}: connected" in proc.output()
        relay.assert_alive()
