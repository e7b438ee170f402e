"""The publisher contract, run against every publisher and the in-memory fake alike.

What the relay relies on (``celery_outbox.broker.base.Publisher``): one result per
message, in order; a broker problem is an outcome, never an exception; a budget
that says stop leaves the rest unsent; a closed publisher reconnects. Each publisher
gets a small harness: a queue of its own, a switch that takes its broker down for
new connections, and a consumer's view of what arrived.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import amqp.exceptions
import pytest
import redis
from kombu import Connection, Queue

from celery_outbox.broker import InMemoryPublisher, Publisher, is_outage
from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.broker.base import FixedBudget, queue_depth
from celery_outbox.broker.kombu import KombuPublisher
from celery_outbox.broker.redis import RedisPublisher
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Outcome, PublishResult

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .builders import envelope

DEAD_AMQP = "amqp://guest:guest@127.0.0.1:1//"
DEAD_REDIS = "redis://127.0.0.1:1/0"
#: How long a batch may take; an unreachable broker must answer well within it.
SECONDS = 5.0

_ids = itertools.count(101, 7)  # row ids no publisher could guess


class BrokerHarness(Protocol):
    """One publisher under test, with its broker seen from outside."""

    #: The queue every message of the test goes to; nothing else uses it.
    queue: str
    #: While True, new connections fail (an open connection is not cut).
    down: bool

    def publisher(self) -> Publisher:
        """A new publisher for this broker."""
        ...

    def arrived(self) -> list[str]:
        """Task ids of the messages in the queue, in the order a worker gets them."""
        ...

    def refused(self) -> StoredMessage:
        """A message this broker refuses (and no other message is to blame for)."""
        ...

    def close(self) -> None:
        """Close every publisher made and remove the queue."""
        ...


class MemoryBroker:
    """The in-memory publisher is its own broker."""

    def __init__(self) -> None:
        self.queue = f"outbox-contract-{uuid.uuid4().hex[:10]}"
        self._down = False
        self._made: list[InMemoryPublisher] = []

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, value: bool) -> None:
        self._down = value
        for publisher in self._made:
            publisher.down = value

    def publisher(self) -> Publisher:
        publisher = InMemoryPublisher(self._refuse)
        publisher.down = self._down
        self._made.append(publisher)
        return publisher

    def arrived(self) -> list[str]:
        return [
            e.task_id
            for publisher in self._made
            for e in publisher.published
            if e.queue == self.queue
        ]

    def refused(self) -> StoredMessage:
        return StoredMessage(next(_ids), 0, envelope("refused", queue=self.queue))

    def _refuse(self, message: StoredMessage) -> PublishResult | None:
        if message.envelope.task_id.startswith("refused"):
            return PublishResult(message.id, Outcome.FAILED, "NotFound: no exchange")
        return None

    def close(self) -> None:
        for publisher in self._made:
            publisher.close()


class KombuBroker:
    """A real broker behind a kombu URL; ``down`` swaps in a port nobody listens on."""

    def __init__(
        self,
        url: str,
        dead_url: str,
        make: Callable[[Callable[[], Any], Callable[[str], Any]], Publisher],
    ) -> None:
        self.queue = f"outbox-contract-{uuid.uuid4().hex[:10]}"
        self.down = False
        self._url = url
        self._dead_url = dead_url
        self._make = make
        self._made: list[Publisher] = []

    def publisher(self) -> Publisher:
        publisher = self._make(
            self._connect, lambda name: Queue(name, routing_key=name)
        )
        self._made.append(publisher)
        return publisher

    def _connect(self) -> Connection:
        return Connection(
            self._dead_url if self.down else self._url,
            connect_timeout=1,
            transport_options={"socket_connect_timeout": 1},
        )

    def arrived(self) -> list[str]:
        raise NotImplementedError

    def refused(self) -> StoredMessage:
        raise NotImplementedError

    def close(self) -> None:
        for publisher in self._made:
            publisher.close()


class AmqpBroker(KombuBroker):
    """RabbitMQ: what arrived is taken off the queue (and remembered)."""

    def __init__(self, make: Callable[..., Publisher]) -> None:
        super().__init__(BROKER_AMQP, DEAD_AMQP, make)
        self._taken: list[str] = []

    def arrived(self) -> list[str]:
        with Connection(BROKER_AMQP) as connection:
            channel = connection.channel()
            try:
                while (
                    message := channel.basic_get(self.queue, no_ack=True)
                ) is not None:
                    self._taken.append(message.headers["id"])
            except amqp.exceptions.NotFound:
                pass  # never declared: nothing was sent to it
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
        return list(self._taken)

    def refused(self) -> StoredMessage:
        missing = f"outbox-missing-{uuid.uuid4().hex[:10]}"
        return StoredMessage(
            next(_ids), 0, envelope("refused", exchange=missing, declare=())
        )

    def close(self) -> None:
        super().close()
        with Connection(BROKER_AMQP) as connection:
            channel = connection.channel()
            channel.queue_delete(self.queue)
            channel.close()


class RedisBroker(KombuBroker):
    """Redis: a queue is a list that workers pop from its right end."""

    def __init__(self, make: Callable[..., Publisher]) -> None:
        super().__init__(BROKER_REDIS, DEAD_REDIS, make)
        self._client = redis.Redis.from_url(BROKER_REDIS)

    def arrived(self) -> list[str]:
        entries = self._client.lrange(self.queue, 0, -1)
        return [json.loads(entry)["headers"]["id"] for entry in reversed(entries)]

    def refused(self) -> StoredMessage:
        blocked = f"{self.queue}-blocked"
        self._client.set(blocked, "not a list")  # LPUSH: WRONGTYPE
        return StoredMessage(
            next(_ids),
            0,
            envelope("refused", routing_key=blocked, declare=(), queue=blocked),
        )

    def close(self) -> None:
        super().close()
        self._client.delete(self.queue, f"{self.queue}-blocked")
        self._client.close()


HARNESSES: dict[str, Callable[[], BrokerHarness]] = {
    "memory": MemoryBroker,
    "amqp-confirm": lambda: AmqpBroker(
        lambda connect, resolve: AmqpPublisher(connect, resolve, confirm=True)
    ),
    "amqp-no-confirm": lambda: AmqpBroker(
        lambda connect, resolve: AmqpPublisher(connect, resolve, confirm=False)
    ),
    "kombu-redis": lambda: RedisBroker(KombuPublisher),
    "redis": lambda: RedisBroker(RedisPublisher),
}


#: Contract tests a publisher is known to fail, and why. Strict: a fix makes them fail
#: until the entry is removed.
KNOWN_DEFECTS = {
    ("test_a_refused_message_fails_alone_and_the_others_arrive_once", "kombu-redis"): (
        "KombuPublisher: when one push of kombu's Redis publish batch is refused, "
        "the whole batch is published again one by one, so the messages the batch "
        "had already pushed arrive twice"
    ),
}


@pytest.fixture(params=list(HARNESSES))
def broker(request: pytest.FixtureRequest) -> Iterator[BrokerHarness]:
    defect = KNOWN_DEFECTS.get((request.node.originalname, request.param))
    if defect is not None:
        request.applymarker(pytest.mark.xfail(reason=defect, strict=True))
    harness = HARNESSES[request.param]()
    try:
        yield harness
    finally:
        harness.close()


class StopAfter(FixedBudget):
    """A budget that lets ``count`` messages start, then says stop (a shutdown)."""

    def __init__(self, count: int) -> None:
        super().__init__(time.monotonic() + SECONDS)
        self.left = count

    def keep_going(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def budget() -> FixedBudget:
    return FixedBudget(time.monotonic() + SECONDS)


def messages(harness: BrokerHarness, count: int) -> list[StoredMessage]:
    """``count`` messages for the harness's queue, each with a fresh row id."""
    queue = harness.queue
    return [
        StoredMessage(
            next(_ids),
            0,
            envelope(f"m{n}", routing_key=queue, declare=(queue,), queue=queue),
        )
        for n in range(count)
    ]


def ids(batch: list[StoredMessage]) -> list[int]:
    return [m.id for m in batch]


def task_ids(batch: list[StoredMessage]) -> list[str]:
    return [m.envelope.task_id for m in batch]


def test_a_batch_gets_one_result_per_message_in_order_and_all_arrive(
    broker: BrokerHarness,
) -> None:
    publisher = broker.publisher()
    first, second = messages(broker, 7), messages(broker, 5)
    for batch in (first, second):  # the second on the connection the first opened
        results = publisher.publish(batch, budget())
        assert [r.message_id for r in results] == ids(batch)
        assert [r.outcome for r in results] == [Outcome.PUBLISHED] * len(batch)
    assert broker.arrived() == task_ids(first) + task_ids(second)


def test_an_empty_batch_has_no_results_and_sends_nothing(
    broker: BrokerHarness,
) -> None:
    assert broker.publisher().publish([], budget()) == []
    broker.down = True
    assert broker.publisher().publish([], budget()) == []
    assert broker.arrived() == []


def test_an_unreachable_broker_is_an_outage_for_every_message_and_never_raises(
    broker: BrokerHarness,
) -> None:
    broker.down = True
    publisher = broker.publisher()
    batch = messages(broker, 3)
    for _ in range(2):  # and again, on the publisher that failed
        started = time.monotonic()
        results = publisher.publish(batch, budget())
        assert time.monotonic() - started < SECONDS
        assert [r.message_id for r in results] == ids(batch)
        assert [r.outcome for r in results] == [Outcome.OUTAGE] * 3
        assert all(r.error for r in results)
        # Nothing reached a connection, so no message can be to blame.
        assert not any(r.in_flight for r in results)
    assert broker.arrived() == []


def test_the_same_publisher_recovers_once_the_broker_is_back(
    broker: BrokerHarness,
) -> None:
    broker.down = True
    publisher = broker.publisher()
    batch = messages(broker, 3)
    assert {r.outcome for r in publisher.publish(batch, budget())} == {Outcome.OUTAGE}
    broker.down = False
    results = publisher.publish(batch, budget())
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * 3
    assert broker.arrived() == task_ids(batch)


def test_a_refused_message_fails_alone_and_the_others_arrive_once(
    broker: BrokerHarness,
) -> None:
    good = messages(broker, 3)
    batch = [good[0], broker.refused(), good[1], good[2]]
    results = broker.publisher().publish(batch, budget())
    assert [r.message_id for r in results] == ids(batch)
    assert [r.outcome for r in results] == [
        Outcome.PUBLISHED,
        Outcome.FAILED,
        Outcome.PUBLISHED,
        Outcome.PUBLISHED,
    ]
    assert results[1].error
    assert broker.arrived() == task_ids(good)


@pytest.mark.parametrize("started", [0, 2])
def test_a_budget_that_says_stop_leaves_the_rest_not_sent(
    broker: BrokerHarness, started: int
) -> None:
    batch = messages(broker, 5)
    results = broker.publisher().publish(batch, StopAfter(started))
    assert [r.message_id for r in results] == ids(batch)
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * started + [
        Outcome.NOT_SENT
    ] * (5 - started)
    assert broker.arrived() == task_ids(batch[:started])


def test_after_close_the_next_batch_reconnects(broker: BrokerHarness) -> None:
    publisher = broker.publisher()
    publisher.close()  # before any connection: harmless
    first, second = messages(broker, 2), messages(broker, 3)
    assert {r.outcome for r in publisher.publish(first, budget())} == {
        Outcome.PUBLISHED
    }
    publisher.close()
    publisher.close()  # twice: harmless
    results = publisher.publish(second, budget())
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * 3
    assert broker.arrived() == task_ids(first) + task_ids(second)


def test_ping_raises_an_outage_only_while_the_broker_is_unreachable(
    broker: BrokerHarness,
) -> None:
    publisher = broker.publisher()
    publisher.ping()
    publisher.ping()  # on the connection the first opened
    publisher.close()
    publisher.ping()
    broker.down = True
    unreachable = broker.publisher()
    try:
        unreachable.ping()
    except Exception as exc:
        assert is_outage(exc), exc
    else:
        pytest.fail("ping() did not raise with the broker unreachable")


def test_depth_counts_what_waits_in_each_queue_whatever_its_priority(
    broker: BrokerHarness,
) -> None:
    # A flow's slot whose task did not start past its lease stays while its queue
    # still holds it: the count must see every message that waits, on kombu's Redis
    # in each priority's list too, and a queue never declared holds none.
    publisher = broker.publisher()
    depth = queue_depth(publisher)
    assert depth is not None
    urgent = StoredMessage(
        next(_ids),
        0,
        envelope(
            "urgent",
            routing_key=broker.queue,
            declare=(broker.queue,),
            queue=broker.queue,
            properties={"delivery_mode": 2, "priority": 9},
        ),
    )
    batch = [*messages(broker, 3), urgent]
    assert [r.outcome for r in publisher.publish(batch, budget())] == [
        Outcome.PUBLISHED
    ] * 4
    missing = f"{broker.queue}-never-declared"
    # Unconfirmed publishes reach the queue a moment after the send returns.
    deadline = time.monotonic() + SECONDS
    while (found := depth([broker.queue, missing]))[broker.queue] < 4:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert found == {broker.queue: 4, missing: 0}


def test_depth_raises_while_the_broker_cannot_be_asked(broker: BrokerHarness) -> None:
    broker.down = True
    depth = queue_depth(broker.publisher())
    assert depth is not None
    with pytest.raises(Exception) as raised:
        depth([broker.queue])
    assert is_outage(raised.value), raised.value
