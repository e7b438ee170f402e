"""The Redis publisher's direct path runs only while kombu's Redis channel is what it
expects; otherwise kombu's ``Producer`` publishes every message.

kombu's in-memory transport stands in for Redis: its channel is kombu's own virtual
channel (the routing, the message documents and their reading are the same code the
Redis channel inherits), given the few names the direct path asks of a Redis channel.
Variants of it change one thing each, as a new kombu might.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Queue
from kombu.transport import memory

from celery_outbox.broker import FixedBudget
from celery_outbox.broker.redis import (
    RedisPublisher,
    direct_path_available,
    direct_path_problem,
)
from celery_outbox.envelope import Envelope, StoredMessage
from celery_outbox.outcomes import Outcome


class RedisLikeChannel(memory.Channel):
    """kombu's in-memory channel, named like kombu's Redis channel where the direct
    path looks. Its ``conn_or_acquire`` fails: no test may reach the pipeline."""

    sep = "\x06\x16"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._expires: dict[str, int] = {}

    def _q_for_pri(self, queue: str, pri: int) -> str:
        return f"{queue}{self.sep}{pri}" if pri else queue

    def conn_or_acquire(self) -> Any:
        raise AssertionError("the direct path was taken")


class PriorityListsRenamed(RedisLikeChannel):
    def _q_for_pri(self, queue: str, pri: int) -> str:
        return f"{queue}{self.sep}{pri}"  # even priority 0 gets a list of its own


class DocumentsWithAnotherField(RedisLikeChannel):
    def prepare_message(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        message: dict[str, Any] = super().prepare_message(*args, **kwargs)
        message["format"] = 2
        return message


class BodiesReadOtherwise(RedisLikeChannel):
    def decode_body(self, body: Any, encoding: Any = None) -> Any:
        return super().decode_body(body, encoding)[::-1]


class ExpiriesGone(RedisLikeChannel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._expires = None  # type: ignore[assignment]


def transport(channel: type[memory.Channel]) -> type[memory.Transport]:
    return type(
        f"{channel.__name__}Transport", (memory.Transport,), {"Channel": channel}
    )


@pytest.fixture
def queue_name() -> Iterator[str]:
    name = f"redis-check-{uuid.uuid4().hex[:10]}"
    yield name
    memory.Channel.queues.pop(name, None)


def test_a_channel_like_kombus_redis_one_passes() -> None:
    with Connection(transport=transport(RedisLikeChannel)) as conn:
        channel = conn.default_channel
        assert direct_path_available(channel)
        assert direct_path_problem(channel) is None


@pytest.mark.parametrize(
    ("channel", "found"),
    [
        (PriorityListsRenamed, "priority 0"),
        (DocumentsWithAnotherField, "fields"),
        (BodiesReadOtherwise, "body"),
        (ExpiriesGone, "raised"),
    ],
)
def test_a_channel_that_changed_fails_the_check(
    channel: type[memory.Channel], found: str
) -> None:
    with Connection(transport=transport(channel)) as conn:
        problem = direct_path_problem(conn.default_channel)
    assert problem is not None
    assert found in problem


@pytest.mark.parametrize(
    "channel", [PriorityListsRenamed, DocumentsWithAnotherField, BodiesReadOtherwise]
)
def test_when_the_check_fails_kombu_publishes_every_message(
    channel: type[memory.Channel],
    queue_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RedisPublisher(
        lambda: Connection(transport=transport(channel)), lambda name: Queue(name)
    )
    publisher.ping()
    sent = []
    for batch in range(2):
        messages = [
            StoredMessage(
                batch * 10 + i,
                0,
                Envelope(
                    task_id=f"t-{batch}-{i}",
                    task_name="shop.record",
                    exchange="",
                    routing_key=queue_name,
                    body=f'[["{batch}-{i}"], {{}}, {{}}]'.encode(),
                    content_type="application/json",
                    content_encoding="utf-8",
                    headers={"id": f"t-{batch}-{i}"},
                    properties={"delivery_mode": 2, "priority": 0},
                    declare=(queue_name,),
                    queue=queue_name,
                ),
            )
            for i in range(3)
        ]
        results = publisher.publish(messages, FixedBudget(time.monotonic() + 10))
        assert {r.outcome for r in results} == {Outcome.PUBLISHED}
        sent += [m.envelope.body for m in messages]
    received = []
    with Connection(transport=transport(RedisLikeChannel)) as conn:
        simple = conn.default_channel  # reads as kombu does
        while (message := simple.basic_get(queue_name, no_ack=True)) is not None:
            received.append(message.body)
    publisher.close()
    assert sorted(received) == sorted(sent)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "celery_outbox.broker" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1  # once, at start, however many batches
    assert "direct Redis path" in warnings[0]


def test_switched_off_the_direct_path_is_not_even_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RedisPublisher(
        lambda: Connection(transport=transport(PriorityListsRenamed)),
        lambda name: Queue(name),
    )
    publisher.direct = False
    publisher.ping()
    publisher.close()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
