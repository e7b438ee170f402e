"""Connecting through a failover list (``celery_outbox.broker.failover``), with no broker:
closed ports of this test stand for nodes that are down."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack

import pytest
from kombu import Connection

from celery_outbox.broker import is_outage
from celery_outbox.broker.failover import (
    NoNodeAnswered,
    connect,
    node_lost,
    publish_again,
)
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Outcome, PublishResult
from tests.proxy import closed_port

from .builders import envelope


@pytest.fixture
def ports() -> Iterator[list[int]]:
    """Three ports of 127.0.0.1 where nothing listens."""
    with ExitStack() as stack:
        socks = [stack.enter_context(closed_port()) for _ in range(3)]
        yield [s.getsockname()[1] for s in socks]


def url(port: int) -> str:
    return f"amqp://guest:secret@127.0.0.1:{port}//"


def test_every_node_is_tried_once_in_order_and_each_is_named(
    ports: list[int],
) -> None:
    connection = Connection(";".join(url(p) for p in ports), connect_timeout=2)
    between: list[int] = []
    with pytest.raises(NoNodeAnswered) as raised:
        connect(connection, lambda: between.append(1))
    failures = raised.value.failures
    assert [node for node, _ in failures] == [
        f"amqp://guest:**@127.0.0.1:{p}//" for p in ports
    ]
    assert is_outage(raised.value)
    assert "secret" not in str(raised.value)
    assert "Connection refused" in str(raised.value)
    assert len(between) == 2  # between the nodes, not after the last


def test_a_url_of_one_node_raises_that_nodes_error(ports: list[int]) -> None:
    with pytest.raises(Exception) as raised:
        connect(Connection(url(ports[0]), connect_timeout=2))
    assert not isinstance(raised.value, NoNodeAnswered)
    assert is_outage(raised.value)


def message(n: int) -> StoredMessage:
    return StoredMessage(n, 0, envelope(f"m{n}"))


def test_publish_again_sends_only_the_outage_and_keeps_in_flight_marks() -> None:
    batch = [message(n) for n in range(1, 5)]
    first = [
        PublishResult(1, Outcome.PUBLISHED),
        PublishResult(2, Outcome.FAILED, "refused"),
        PublishResult(3, Outcome.OUTAGE, "lost", in_flight=True),
        PublishResult(4, Outcome.OUTAGE, "lost"),
    ]
    sent: list[list[int]] = []

    def again(rest: Sequence[StoredMessage]) -> list[PublishResult]:
        sent.append([m.id for m in rest])
        return [PublishResult(m.id, Outcome.OUTAGE, "no node") for m in rest]

    merged = publish_again(batch, first, again)
    assert sent == [[3, 4]]
    assert merged == [
        first[0],
        first[1],
        PublishResult(3, Outcome.OUTAGE, "no node", in_flight=True),
        PublishResult(4, Outcome.OUTAGE, "no node"),
    ]
    published = publish_again(
        batch,
        first,
        lambda rest: [PublishResult(m.id, Outcome.PUBLISHED) for m in rest],
    )
    assert [r.outcome for r in published] == [
        Outcome.PUBLISHED,
        Outcome.FAILED,
        Outcome.PUBLISHED,
        Outcome.PUBLISHED,
    ]


def test_a_broken_connection_of_a_failover_list_is_a_lost_node_a_timeout_is_not(
    ports: list[int],
) -> None:
    cluster = Connection(";".join(url(p) for p in ports[:2]))
    single = Connection(url(ports[0]))
    assert node_lost(cluster, ConnectionResetError("reset by peer"))
    assert not node_lost(cluster, TimeoutError("confirms did not arrive"))
    assert not node_lost(single, ConnectionResetError("reset by peer"))
    assert not node_lost(None, ConnectionResetError("never connected"))
