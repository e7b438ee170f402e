"""Queue declarations as stored with a row, and rebuilt by the relay."""

from __future__ import annotations

import json

from kombu import Exchange, Queue, binding

from celery_outbox.queues import cached_queue_spec, queue_from_spec, queue_spec


def test_a_queue_survives_the_trip_through_its_spec() -> None:
    exchange = Exchange("orders", type="topic", durable=False)
    queue = Queue(
        "orders.mail",
        exchange,
        routing_key="orders.*",
        queue_arguments={"x-max-priority": 10},
    )
    rebuilt = queue_from_spec(json.loads(queue_spec(queue)))
    assert rebuilt.name == "orders.mail"
    assert rebuilt.routing_key == "orders.*"
    assert rebuilt.queue_arguments == {"x-max-priority": 10}
    assert (rebuilt.exchange.name, rebuilt.exchange.type) == ("orders", "topic")
    assert rebuilt.exchange.durable is False


def test_bindings_survive_too() -> None:
    exchange = Exchange("ex", type="direct")
    queue = Queue("q", bindings=[binding(exchange, "b"), binding(exchange, "a")])
    rebuilt = queue_from_spec(json.loads(queue_spec(queue)))
    assert sorted(b.routing_key for b in rebuilt.bindings) == ["a", "b"]
    assert {b.exchange.name for b in rebuilt.bindings} == {"ex"}


def test_the_spec_is_remembered_per_queue_object() -> None:
    first = Queue("same-name", queue_arguments={"x-max-priority": 5})
    other = Queue("same-name", queue_arguments={"x-max-priority": 9})
    assert cached_queue_spec(first) is cached_queue_spec(first)
    assert '"x-max-priority": 9' in cached_queue_spec(other)
    assert '"x-max-priority": 5' in cached_queue_spec(first)
