"""Topic routing on kombu's virtual transports follows RabbitMQ's rules."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu import Connection, Exchange, Queue

from celery_outbox.broker.topics import topic_expression, use_rabbit_topics
from celery_outbox.events.names import matches

#: (binding key, routing key, whether RabbitMQ routes it).
RABBITMQ = [
    ("order.#", "order", True),
    ("order.#", "order.created", True),
    ("order.#", "order.created.eu", True),
    ("order.#", "orders", False),
    ("order.*", "order", False),
    ("order.*", "order.created", True),
    ("order.*", "order.created.eu", False),
    ("*.created", "created", False),
    ("*.created", "order.created", True),
    ("#.created", "created", True),
    ("#.created", "order.eu.created", True),
    ("#.created", "order.createdx", False),
    ("order.#.eu", "order.eu", True),
    ("order.#.eu", "order.a.b.eu", True),
    ("order.#.eu", "order.a.b", False),
    ("#", "order.created", True),
    ("a.#.#.b", "a.b", True),
    ("order.created", "order.created", True),
    ("order.created", "order.Created", False),
]


@pytest.mark.parametrize(("binding", "key", "routed"), RABBITMQ)
def test_the_expression_routes_as_rabbitmq(
    binding: str, key: str, routed: bool
) -> None:
    assert bool(topic_expression(binding).match(key)) is routed


_words = st.lists(
    st.sampled_from(["a", "b", "order", "*", "#"]), min_size=1, max_size=6
)


@given(_words, _words)
def test_the_expression_agrees_with_the_events_matcher(
    binding: list[str], key: list[str]
) -> None:
    key = [word for word in key if word not in {"*", "#"}] or ["a"]
    assert bool(topic_expression(".".join(binding)).match(".".join(key))) is matches(
        ".".join(binding), ".".join(key)
    )


@pytest.mark.parametrize(("binding", "key", "routed"), RABBITMQ)
def test_a_kombu_channel_routes_as_rabbitmq(
    binding: str, key: str, routed: bool
) -> None:
    """kombu's in-memory transport, a virtual transport as Redis is."""
    name = f"topics-{uuid.uuid4().hex[:8]}"  # the transport's state is per process
    with Connection("memory://") as connection:
        channel = connection.channel()
        use_rabbit_topics(channel)
        exchange = Exchange(name, type="topic")
        Queue(name, exchange=exchange, routing_key=binding)(channel).declare()
        exchange(channel).publish(exchange(channel).Message("hi"), routing_key=key)
        got = channel.basic_get(name, no_ack=True)
        channel.queue_delete(name)
        assert (got is not None) is routed
