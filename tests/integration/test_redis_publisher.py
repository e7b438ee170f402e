"""The Redis publisher writes exactly what kombu's own Redis transport writes.

Each case publishes the same stored messages once through kombu's ``Producer`` (the
reference) and once through :class:`RedisPublisher`, then compares every Redis list
the two left behind: same keys (queues, priority lists, key prefix), same JSON
documents, except the delivery tag, which is fresh for every publish.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from packaging.version import Version

from celery_outbox.broker import FixedBudget
from celery_outbox.broker.kombu import KombuPublisher
from celery_outbox.broker.redis import RedisPublisher, direct_path_available
from celery_outbox.envelope import JsonObject, StoredMessage, dump_json
from celery_outbox.outcomes import Outcome
from tests import topologies

from ..conftest import BROKER_REDIS
from .builders import envelope

UUID4 = re.compile(
    r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
)


@dataclass
class Names:
    """One test's queue, exchange and key prefix, all unique to it."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    @property
    def queue(self) -> str:
        return f"outbox-redis-{self.tag}"

    @property
    def exchange(self) -> str:
        return f"outbox-redis-ex-{self.tag}"

    @property
    def prefix(self) -> str:
        return f"outbox-prefix-{self.tag}:"


@pytest.fixture
def names() -> Iterator[Names]:
    found = Names()
    yield found
    client = redis.Redis.from_url(BROKER_REDIS)
    keys = list(client.scan_iter(match=f"*{found.tag}*"))
    if keys:
        client.delete(*keys)


def snapshot(tag: str, url: str = BROKER_REDIS) -> dict[str, list[dict[str, Any]]]:
    """Every list whose name holds ``tag``: its decoded entries, delivery tags checked and dropped."""
    client = redis.Redis.from_url(url)
    lists: dict[str, list[dict[str, Any]]] = {}
    for key in client.scan_iter(match=f"*{tag}*"):
        if client.type(key) != b"list":
            continue
        entries = []
        for raw in client.lrange(key, 0, -1):
            document = json.loads(raw)
            delivery_tag = document["properties"].pop("delivery_tag")
            assert UUID4.match(delivery_tag), delivery_tag
            entries.append(document)
        lists[key.decode()] = entries
        client.delete(key)
    return lists


def as_claimed(message: StoredMessage) -> StoredMessage:
    """``message`` as a claim returns it: headers and properties still JSON text."""
    envelope = dataclasses.replace(
        message.envelope,
        headers=JsonObject(dump_json(dict(message.envelope.headers))),
        properties=JsonObject(dump_json(dict(message.envelope.properties))),
    )
    return dataclasses.replace(message, envelope=envelope)


@pytest.fixture(params=["built", "claimed"])
def claimed(request: pytest.FixtureRequest) -> bool:
    """Run a case with messages as built in memory and as claimed from the table."""
    return bool(request.param == "claimed")


def publish_both(
    names: Names,
    messages: list[StoredMessage],
    resolve: Callable[[str], Any],
    transport_options: dict[str, Any] | None = None,
    *,
    claimed: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what kombu's Producer left in Redis, what RedisPublisher left) for ``messages``."""
    left = []
    if claimed:
        messages = [as_claimed(m) for m in messages]
    for kind in (KombuPublisher, RedisPublisher):
        publisher = kind(
            lambda: Connection(BROKER_REDIS, transport_options=transport_options or {}),
            resolve,
        )
        try:
            results = publisher.publish(messages, FixedBudget(time.monotonic() + 10))
        finally:
            publisher.close()
        assert {r.outcome for r in results} == {Outcome.PUBLISHED}
        left.append(snapshot(names.tag))
    return left[0], left[1]


def stored(*envelopes: Any) -> list[StoredMessage]:
    return [StoredMessage(i + 1, 0, e) for i, e in enumerate(envelopes)]


def test_the_direct_path_is_taken_from_kombu_5_7_on_and_left_alone_before() -> None:
    """kombu 5.7 added the channel API the direct path needs; older kombu falls back."""
    installed = Version(importlib.metadata.version("kombu"))
    with Connection(BROKER_REDIS) as conn:
        assert direct_path_available(conn.default_channel) == (
            installed >= Version("5.7")
        )


def test_default_exchange_messages_match_kombu(names: Names, claimed: bool) -> None:
    queue = names.queue
    messages = stored(
        envelope("plain", routing_key=queue, declare=(queue,), queue=queue),
        envelope(
            "no-mode",
            routing_key=queue,
            declare=(queue,),
            properties={"correlation_id": "c-1", "reply_to": "replies"},
        ),
        envelope(
            "expiring",
            routing_key=queue,
            declare=(queue,),
            properties={
                "correlation_id": "c-2",
                "delivery_mode": 2,
                "expiration": "60000",
            },
        ),
        envelope(
            "binary",
            routing_key=queue,
            declare=(queue,),
            body=bytes(range(256)),
            content_type="application/x-python-serialize",
            content_encoding="binary",
        ),
        envelope(
            "unicode",
            routing_key=queue,
            declare=(queue,),
            headers={"id": "u", "argsrepr": "('žluťoučký kůň', '✓')", "eta": None},
        ),
    )
    reference, ours = publish_both(
        names, messages, lambda n: Queue(n, routing_key=n), claimed=claimed
    )
    assert list(reference) == [queue]
    assert ours == reference


def test_priorities_land_in_kombus_priority_lists(names: Names, claimed: bool) -> None:
    queue = names.queue
    messages = stored(
        *(
            envelope(
                f"p{priority}",
                routing_key=queue,
                declare=(queue,),
                properties={"delivery_mode": 2, "priority": priority},
            )
            for priority in (0, 1, 3, 5, 8, 9)
        ),
    )
    reference, ours = publish_both(
        names,
        messages,
        lambda n: Queue(n, routing_key=n, max_priority=9),
        claimed=claimed,
    )
    assert len(reference) == 4  # kombu's default steps: 0, 3, 6, 9
    assert ours == reference


def test_a_named_exchange_routes_through_its_bindings(names: Names) -> None:
    exchange = Exchange(names.exchange, type="direct")
    queue = Queue(names.queue, exchange, routing_key="mail.receipt")
    messages = stored(
        envelope(
            "routed",
            exchange=names.exchange,
            routing_key="mail.receipt",
            declare=(names.queue,),
        ),
    )
    reference, ours = publish_both(names, messages, lambda n: queue)
    assert list(reference) == [names.queue]
    assert ours == reference


RESTORE_IN_A_PROCESS = """
import sys
from kombu import Connection

url, queue = sys.argv[1:3]
with Connection(url) as conn:
    channel = conn.channel()
    message = channel.basic_get(queue, no_ack=False)
    assert message is not None, "no copy to take"
    channel.close()  # not acknowledged: kombu puts it back (restore_unacked)
"""


def publish_an_event(
    names: Names, kind: type[RedisPublisher]
) -> tuple[Queue, Queue, list[StoredMessage]]:
    """One event published by ``kind`` to two services' queues through a topic
    exchange: (billing's queue, shipping's queue, the stored message)."""
    exchange = Exchange(names.exchange, type="topic")
    billing = Queue(f"{names.queue}-billing", exchange, routing_key="order.*")
    shipping = Queue(f"{names.queue}-shipping", exchange, routing_key="order.created")
    queues = {queue.name: queue for queue in (billing, shipping)}
    messages = stored(
        envelope(
            "order-created",
            exchange=names.exchange,
            routing_key="order.created",
            declare=tuple(queues),
        )
    )
    publisher = kind(lambda: Connection(BROKER_REDIS), queues.__getitem__)
    try:
        results = publisher.publish(messages, FixedBudget(time.monotonic() + 10))
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [Outcome.PUBLISHED]
    return billing, shipping, messages


class ThroughKombu(RedisPublisher):
    """The publisher as it runs on a kombu without the direct path's API (< 5.7)."""

    direct = False


@pytest.mark.parametrize("kind", [RedisPublisher, ThroughKombu])
def test_a_copy_a_worker_did_not_acknowledge_goes_back_to_its_own_list_only(
    names: Names, kind: type[RedisPublisher]
) -> None:
    """An event to two services' queues by a topic. A worker of one service takes
    its copy and goes away without acknowledging it (killed, or a visibility
    timeout passed): kombu puts the copy back by routing its delivery info again, in
    a process whose channel never declared the events exchange (a worker's does
    not). It must land in that service's list again, and only there."""
    billing, shipping, messages = publish_an_event(names, kind)
    client = redis.Redis.from_url(BROKER_REDIS)
    assert (client.llen(billing.name), client.llen(shipping.name)) == (1, 1)

    subprocess.run(
        [sys.executable, "-c", RESTORE_IN_A_PROCESS, BROKER_REDIS, billing.name],
        check=True,
        timeout=60,
    )

    assert (client.llen(billing.name), client.llen(shipping.name)) == (1, 1)
    (back,) = client.lrange(billing.name, 0, -1)
    document = json.loads(back)
    assert document["headers"]["id"] == messages[0].envelope.task_id
    assert document["properties"]["delivery_info"] == {
        "exchange": "",
        "routing_key": billing.name,
        "redelivered": True,  # kombu's mark on a copy it put back
    }


HOLD_ONE_ACKNOWLEDGE_THE_OTHER = """
import sys
from kombu import Connection

url, held, acknowledged = sys.argv[1:4]
with Connection(url) as running, Connection(url) as done:
    channel = running.channel()
    assert channel.basic_get(held, no_ack=False) is not None, "no copy to hold"
    other = done.channel()
    message = other.basic_get(acknowledged, no_ack=False)
    assert message is not None, "no copy to acknowledge"
    other.basic_ack(message.delivery_tag)
    other.close()
    channel.close()  # not acknowledged: kombu puts it back (restore_unacked)
"""


@pytest.mark.parametrize("kind", [RedisPublisher, ThroughKombu])
def test_a_copy_acknowledged_in_one_list_leaves_the_other_lists_copies_unacknowledged(
    names: Names, kind: type[RedisPublisher]
) -> None:
    """An event to two services' queues. Shipping's worker holds its copy; billing's
    takes its own and acknowledges it; then shipping's goes away without
    acknowledging (killed). kombu keeps a taken copy in its ``unacked`` hash by
    delivery tag and an ack deletes that tag's entry: copies that shared one tag
    shared one entry, and billing's ack deleted shipping's, whose copy was lost.
    Each copy has a tag of its own: shipping's goes back to its list."""
    billing, shipping, messages = publish_an_event(names, kind)
    queues = {queue.name: queue for queue in (billing, shipping)}
    client = redis.Redis.from_url(BROKER_REDIS)
    tags = {
        json.loads(raw)["properties"]["delivery_tag"]
        for queue in queues
        for raw in client.lrange(queue, 0, -1)
    }
    assert len(tags) == 2  # one per copy

    subprocess.run(
        [
            sys.executable, "-c", HOLD_ONE_ACKNOWLEDGE_THE_OTHER, BROKER_REDIS,
            shipping.name, billing.name,
        ],
        check=True,
        timeout=60,
    )  # fmt: skip

    assert (client.llen(billing.name), client.llen(shipping.name)) == (0, 1)
    (back,) = client.lrange(shipping.name, 0, -1)
    assert json.loads(back)["headers"]["id"] == messages[0].envelope.task_id
    assert not [tag for tag in tags if client.hexists("unacked", tag)]


def test_a_global_key_prefix_is_kept(names: Names) -> None:
    queue = names.queue
    messages = stored(envelope("prefixed", routing_key=queue, declare=(queue,)))
    reference, ours = publish_both(
        names,
        messages,
        lambda n: Queue(n, routing_key=n),
        {"global_keyprefix": names.prefix},
    )
    assert list(reference) == [names.prefix + queue]
    assert ours == reference


def test_stored_header_text_is_sent_as_it_is(names: Names) -> None:
    """Headers claimed from the table are never decoded: their text goes out unchanged."""
    queue = names.queue
    text = dump_json({"id": "t-1", "task": "shop.record", "nested": {"a": [1, 2.5]}})
    message = StoredMessage(
        1,
        0,
        envelope("text", routing_key=queue, declare=(queue,), headers=JsonObject(text)),
    )
    publisher = RedisPublisher(lambda: Connection(BROKER_REDIS), lambda n: Queue(n))
    try:
        results = publisher.publish([message], FixedBudget(time.monotonic() + 10))
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [Outcome.PUBLISHED]
    (raw,) = redis.Redis.from_url(BROKER_REDIS).lrange(queue, 0, -1)
    assert f'"headers": {text}, '.encode() in raw


def test_a_fanout_exchange_goes_through_kombu(names: Names) -> None:
    """Fanout on Redis is PUBLISH to subscribers: the publisher hands it to kombu."""
    exchange = Exchange(names.exchange, type="fanout")
    queue = Queue(names.queue, exchange)
    client = redis.Redis.from_url(BROKER_REDIS)
    subscriber = client.pubsub()
    subscriber.psubscribe(f"*{names.exchange}*")
    assert subscriber.get_message(timeout=2)["type"] == "psubscribe"
    message = StoredMessage(
        1,
        0,
        envelope(
            "fan", exchange=names.exchange, routing_key="", declare=(names.queue,)
        ),
    )
    publisher = RedisPublisher(lambda: Connection(BROKER_REDIS), lambda n: queue)
    try:
        results = publisher.publish([message], FixedBudget(time.monotonic() + 10))
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [Outcome.PUBLISHED]
    received = subscriber.get_message(timeout=5)
    subscriber.close()
    assert received is not None and received["type"] == "pmessage"
    document = json.loads(received["data"])
    assert document["headers"]["id"] == message.envelope.task_id
    assert snapshot(names.tag) == {}


def test_a_batch_stops_when_the_budget_says_so(names: Names) -> None:
    queue = names.queue
    messages = stored(
        *(envelope(f"m{i}", routing_key=queue, declare=(queue,)) for i in range(5)),
    )

    class StopAfterTwo(FixedBudget):
        calls = 0

        def keep_going(self) -> bool:
            self.calls += 1
            return self.calls <= 2

    publisher = RedisPublisher(lambda: Connection(BROKER_REDIS), lambda n: Queue(n))
    try:
        results = publisher.publish(messages, StopAfterTwo(time.monotonic() + 10))
    finally:
        publisher.close()
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * 2 + [
        Outcome.NOT_SENT
    ] * 3
    assert redis.Redis.from_url(BROKER_REDIS).llen(queue) == 2


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a Redis server of this module's own: its command counts are the
    publisher's alone (the shared server's count every test run's pushes)."""
    with topologies.redis_server(tmp_path_factory.mktemp("own-redis")) as server:
        yield server.url


def lpush_calls(url: str) -> int:
    """How many LPUSH commands the Redis server at ``url`` has run since it started."""
    stats = redis.Redis.from_url(url).info("commandstats")
    return int(stats.get("cmdstat_lpush", {}).get("calls", 0))


@pytest.mark.parametrize(
    ("push_bytes", "commands"),
    [
        (RedisPublisher.PUSH_BYTES, 2),  # one LPUSH for each list
        (1, 15),  # every message over the limit: one LPUSH each
        (3_000, 8),  # two messages of ~1.4 KB a command: 5 + 3
    ],
)
def test_each_list_gets_one_push_with_its_messages_in_order(
    names: Names, own_redis: str, push_bytes: int, commands: int
) -> None:
    first, second = names.queue, f"{names.queue}-second"
    envelopes = []
    for i in range(15):
        queue = first if i % 3 else second  # 10 for the first list, 5 for the second
        envelopes.append(
            envelope(
                f"m{i:02}",
                task_id=f"m{i:02}",
                routing_key=queue,
                declare=(queue,),
                queue=queue,
                headers={"id": f"m{i:02}", "pad": "x" * 1000},
            )
        )
    messages = stored(*envelopes)
    publisher = RedisPublisher(
        lambda: Connection(own_redis), lambda n: Queue(n, routing_key=n)
    )
    publisher.PUSH_BYTES = push_bytes
    try:
        publisher.publish(messages[:1], FixedBudget(time.monotonic() + 10))
        publisher.publish(messages[2:3], FixedBudget(time.monotonic() + 10))
        client = redis.Redis.from_url(own_redis)
        client.delete(first, second)  # both queues are declared now
        before = lpush_calls(own_redis)
        results = publisher.publish(messages, FixedBudget(time.monotonic() + 10))
        after = lpush_calls(own_redis)
    finally:
        publisher.close()
    assert {r.outcome for r in results} == {Outcome.PUBLISHED}
    with Connection(own_redis) as conn:
        direct = direct_path_available(conn.default_channel)
    # Before kombu 5.7 the publisher falls back to kombu's Producer: one each.
    assert after - before == (commands if direct else len(messages))
    lists = snapshot(names.tag, own_redis)
    # A consumer pops from the right: the oldest message first.
    for queue in (first, second):
        popped = [entry["headers"]["id"] for entry in reversed(lists[queue])]
        expected = [e.task_id for e in envelopes if e.routing_key == queue]
        assert popped == expected
