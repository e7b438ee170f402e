"""Events against a real database and RabbitMQ: firing writes one row in the caller's
transaction; the topology is declared idempotently; the archive can be listed,
replayed and purged."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from kombu import Connection

from celery_outbox import OutboxCelery
from celery_outbox.conf import get_settings
from celery_outbox.events import archive
from celery_outbox.events.declare import declare
from celery_outbox.events.topology import ServiceTopology
from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.models import OutboxMessage
from tests.events_project.catalog import declare_events

from ..conftest import BROKER_AMQP

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exchange() -> Iterator[str]:
    """A unique events exchange; every queue and exchange under it is deleted after."""
    name = f"test-events-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=name, CELERY_OUTBOX_EVENTS_MAX_RETRIES=2
    ):
        yield name
    delete_topology(name, ["billing"], 2)


@pytest.fixture(name="order_created")
def order_created_fixture() -> Iterator[Any]:
    """``order.created`` on a shop app of this test only: an app left alive would
    make the in-process relay of later tests unable to tell which app is theirs."""
    app = OutboxCelery("shop", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    yield declare_events(app)


def delete_topology(
    name: str, services: list[str], steps: int, patterns: tuple[str, ...] = ("order.*",)
) -> None:
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        channel = connection.channel()
        queues = [f"{name}:unrouted"]
        exchanges = [name, f"{name}:unrouted"]
        for service in services:
            prefix = f"{name}:{service}"
            queues += [f"{prefix}:{p}" for p in patterns] + [f"{prefix}:archive"]
            queues += [f"{prefix}:retry:{n}" for n in range(steps)]
            exchanges += [f"{prefix}:recover", f"{prefix}:archive"]
            exchanges += [f"{prefix}:retry:{n}" for n in range(steps)]
        for queue in queues:
            channel.queue_delete(queue)
        for each in exchanges:
            channel.exchange_delete(each)
        channel.close()


def test_fire_writes_one_row_to_the_events_exchange(
    exchange: str, order_created: Any
) -> None:
    with transaction.atomic():
        order_created(7, "9.90")
    (row,) = OutboxMessage.objects.all()
    assert row.exchange == exchange
    assert row.routing_key == "order.created"
    assert row.task_name == "celery_outbox.events.deliver"
    assert json.loads(row.headers)["outbox_event"] == "order.created"
    assert f"{exchange}:unrouted" in row.declare_queues


def test_validation_error_and_rollback_write_nothing(
    exchange: str, order_created: Any
) -> None:
    with pytest.raises(ValueError, match="negative"), transaction.atomic():
        order_created(-1, "0")
    with pytest.raises(RuntimeError), transaction.atomic():
        order_created.fire(1, "1")
        raise RuntimeError("roll back")
    assert OutboxMessage.objects.count() == 0


def test_declare_is_idempotent_and_a_changed_queue_is_explained(exchange: str) -> None:
    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        declare(connection, topology.all_queues(), get_settings())
        declare(connection, topology.all_queues(), get_settings())
        assert archive.stats(connection, topology)[topology.archive_name] == 0
        with override_settings(CELERY_OUTBOX_EVENTS_ARCHIVE_MAX_LENGTH=5):
            changed = ServiceTopology(get_settings(), "billing", ("order.*",))
            with pytest.raises(OutboxConfigurationError, match="exists with other"):
                declare(connection, changed.all_queues(), get_settings())


def test_an_event_nobody_handles_is_not_refused_by_the_broker(exchange: str) -> None:
    """The relay publishes with ``mandatory``: the alternate exchange takes it."""
    import amqp

    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        declare(connection, topology.all_queues(), get_settings())
        returned: list[Any] = []
        channel = connection.channel()
        channel.events["basic_return"].add(lambda *a: returned.append(a))
        channel.basic_publish_confirm(
            amqp.Message(b"{}"),
            exchange=exchange,
            routing_key="nobody.cares",
            mandatory=True,
        )
        channel.close()
    assert returned == []


def test_archive_list_replay_and_purge(exchange: str) -> None:
    import amqp

    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    queue = topology.queue_name("order.*")
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        declare(connection, topology.all_queues(), get_settings())
        channel = connection.channel()
        for number in range(3):
            headers = {
                "id": f"id-{number}",
                "outbox_event": f"order.e{number}",
                "retries": 2,
                "outbox_error": "boom",
            }
            channel.basic_publish_confirm(
                amqp.Message(b"[]", application_headers=headers),
                exchange=topology.archive_name,
                routing_key=queue,
            )
        channel.close()
        assert archive.count(connection, topology) == 3
        listed = archive.list_archive(connection, topology)
        assert [(e.id, e.queue, e.retries, e.error) for e in listed] == [
            (f"id-{n}", queue, 2, "boom") for n in range(3)
        ]
        assert archive.count(connection, topology) == 3  # listing took nothing
        progress: list[tuple[int, int]] = []
        result = archive.replay(
            connection,
            topology,
            ids=["id-1"],
            on_progress=lambda *a: progress.append(a),
        )
        assert (result.replayed, result.left) == (1, 2)
        assert progress == [(1, 3)]
        result = archive.replay(connection, topology, event="order.e2")
        assert result.replayed == 1
        assert archive.count(connection, topology) == 1
        channel = connection.channel()
        back = [channel.basic_get(queue, no_ack=True) for _ in range(2)]
        channel.close()
        assert sorted(m.headers["id"] for m in back) == ["id-1", "id-2"]
        assert all(
            m.headers["retries"] == 0 and "outbox_error" not in m.headers for m in back
        )
        assert archive.purge(connection, topology) == 1
        assert archive.count(connection, topology) == 0


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_retried_message_comes_back_to_its_own_queue_only(
    exchange: str, queue_type: str
) -> None:
    """Retry step 0 holds it 1 s, then the recover exchange routes it back by the
    queue's name: to the queue it failed in, not to the service's other queues."""
    import time

    import amqp

    with override_settings(CELERY_OUTBOX_EVENTS_QUEUE_TYPE=queue_type):
        topology = ServiceTopology(get_settings(), "billing", ("order.*", "pay.*"))
        with Connection(BROKER_AMQP, connect_timeout=5) as connection:
            try:
                declare(connection, topology.all_queues(), get_settings())
                channel = connection.channel()
                sent = time.monotonic()
                channel.basic_publish_confirm(
                    amqp.Message(b"[]", application_headers={"id": "r"}),
                    exchange=topology.retry_exchange(0).name,
                    routing_key=topology.queue_name("order.*"),
                )
                message = None
                while message is None and time.monotonic() - sent < 10:
                    time.sleep(0.05)
                    message = channel.basic_get(
                        topology.queue_name("order.*"), no_ack=True
                    )
                waited = time.monotonic() - sent
                assert message is not None and message.headers["id"] == "r"
                assert 0.9 <= waited <= 1.6
                other = channel.basic_get(topology.queue_name("pay.*"), no_ack=True)
                assert other is None
                channel.close()
            finally:
                delete_topology(exchange, ["billing"], 2, ("order.*", "pay.*"))
