"""Fidelity: the message the relay puts on the broker is the one plain Celery would publish.

For every case in :data:`CASES` two apps are built from the same configuration: a plain
``celery.Celery`` and an ``OutboxCelery``. The same call (same explicit task id) is made
on both. The plain app publishes straight to the broker; the outbox app writes a row in a
committed transaction, and a real relay cycle publishes it. Both messages are then read
raw from the broker (RabbitMQ or Redis, no mocks) and compared field by field: every
header, every property, the delivery exchange and routing key, the content type and
encoding, and the body bytes.

Documented differences, checked rather than ignored:

* ``reply_to`` is each app's own ``thread_oid``;
* values computed from the clock at call time (an eta from a countdown, the expires of a
  relative ``expires=``, the TTL of an absolute ``expires=``) are checked against each
  app's own call window, and for the outbox the relay runs well after that window, so a
  value computed at relay time fails.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import decimal
import gc
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, chain, group, signals
from celery import __version__ as celery_version
from celery.canvas import Signature
from django.db import transaction
from kombu import Connection, Exchange, Queue
from kombu.message import Message

from celery_outbox import OutboxCelery
from celery_outbox import app as outbox_app_module
from celery_outbox.broker import build_publisher
from celery_outbox.conf import get_settings
from celery_outbox.engine.loop import Turn
from celery_outbox.models import OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import outbox_stores

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
REDIS_URL = "redis://127.0.0.1:6379/14"
BROKERS = {"amqp": AMQP_URL, "redis": REDIS_URL}

#: How long the relay waits after the call, so a value computed at relay time shows.
RELAY_DELAY = 0.3
#: Slack for microsecond rounding when checking a value against its call window.
SLACK = dt.timedelta(milliseconds=2)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _relay_publishes(settings: Any) -> None:
    """The rows must wait for the test's relay cycle, not be published on commit."""
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False


@dataclass(frozen=True)
class Names:
    """Unique broker names and task ids of one test."""

    queue: str
    other: str
    exchange: str
    ids: tuple[str, ...]

    @classmethod
    def new(cls) -> Names:
        tag = uuid.uuid4().hex[:12]
        return cls(
            queue=f"fid-{tag}",
            other=f"fid-{tag}-other",
            exchange=f"fid-{tag}-ex",
            ids=tuple(str(uuid.uuid4()) for _ in range(4)),
        )

    @property
    def task_id(self) -> str:
        return self.ids[0]


Send = Callable[[Celery, Names], None]
Check = Callable[[Message, Names], None]


@dataclass(frozen=True)
class Case:
    """One row of the table: configuration, the call, and what the plain message shows."""

    id: str
    send: Send
    #: Sanity check on the plain app's message: the option really took effect.
    check: Check
    conf: Callable[[Names], Mapping[str, Any]] = lambda names: {}
    broker: str = "amqp"
    count: int = 1
    queue: Callable[[Names], str] = lambda names: names.queue
    #: Headers computed at call time: header name -> seconds after the call.
    anchored: Mapping[str, float] = field(default_factory=dict)
    #: With an absolute ``expires=``, the ``expiration`` TTL is counted from the call.
    expiration_until: dt.datetime | None = None
    #: A known fidelity bug: the case is a strict xfail until it is fixed.
    known_bug: str | None = None


def call(
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Callable[[Names], Mapping[str, Any]] = lambda names: {},
) -> Send:
    """``fid.work.apply_async(args, kwargs, task_id=names.task_id, **options)``."""

    def send(app: Celery, names: Names) -> None:
        app.tasks["fid.work"].apply_async(
            args, dict(kwargs or {}), task_id=names.task_id, **options(names)
        )

    return send


def sig(app: Celery, names: Names, index: int, *args: Any) -> Signature:
    """A signature of ``fid.work`` bound to ``app`` with a fixed task id."""
    return app.signature("fid.work", args=args, options={"task_id": names.ids[index]})


def send_chain(app: Celery, names: Names) -> None:
    chain(sig(app, names, 0, 1), sig(app, names, 1), sig(app, names, 2)).apply_async()


def send_group(app: Celery, names: Names) -> None:
    group(sig(app, names, 0, 1), sig(app, names, 1, 2)).apply_async(
        task_id=names.ids[3]
    )


def send_with_links(app: Celery, names: Names) -> None:
    app.tasks["fid.work"].apply_async(
        (1,),
        task_id=names.task_id,
        link=sig(app, names, 1, "ok"),
        link_error=[sig(app, names, 2, "err-a"), sig(app, names, 3, "err-b")],
    )


def send_from_running_task(app: Celery, names: Names) -> None:
    """Root task runs a parent task, which sends the child (ids[0]) while running."""
    app.tasks["fid.root"].apply(args=(names.ids[0], names.ids[1]), task_id=names.ids[2])


#: Celery's eager ``Task.apply`` records the running task as the root of the task it
#: runs only from 5.6 on; before, the parent it runs is its own root. Plain Celery
#: and the outbox are held to the same value either way.
EAGER_APPLY_KNOWS_ITS_ROOT = tuple(int(p) for p in celery_version.split(".")[:2]) >= (
    5,
    6,
)


def root_of_running_task(names: Names) -> str:
    """The ``root_id`` Celery gives the child of :func:`send_from_running_task`."""
    return names.ids[2] if EAGER_APPLY_KNOWS_ITS_ROOT else names.ids[1]


def send_task_by_name(app: Celery, names: Names) -> None:
    app.send_task("fid.remote", args=(1, 2), task_id=names.task_id)


#: Absolute expiry: RabbitMQ refuses a per-message TTL beyond about 50 days.
EXPIRES_AT = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=6)).replace(
    microsecond=678000
)
ETA = dt.datetime(2099, 12, 31, 23, 59, 58, 123456, tzinfo=dt.timezone.utc)
RICH_ARGS = (
    dt.date(2024, 2, 29),
    dt.datetime(2024, 2, 29, 12, 30, 1, 5, tzinfo=dt.timezone.utc),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    decimal.Decimal("12.340"),
)
RICH_KWARGS = {"when": dt.datetime(2023, 1, 1, 8, 0), "amount": decimal.Decimal("-0.5")}


def _expected(value: Any, names: Names) -> Any:
    return value(names) if callable(value) else value


def header(name: str, value: Any) -> Check:
    """The header ``name`` is ``value`` (or ``value(names)`` when callable)."""

    def check(message: Message, names: Names) -> None:
        assert message.headers[name] == _expected(value, names)

    return check


def prop(name: str, value: Any) -> Check:
    """The property ``name`` is ``value`` (or ``value(names)`` when callable)."""

    def check(message: Message, names: Names) -> None:
        assert message.properties[name] == _expected(value, names)

    return check


def both(*checks: Check) -> Check:
    def check(message: Message, names: Names) -> None:
        for one in checks:
            one(message, names)

    return check


def decoded(predicate: Callable[[Any, Names], bool]) -> Check:
    def check(message: Message, names: Names) -> None:
        assert predicate(message.decode(), names)

    return check


def content_type(value: str) -> Check:
    def check(message: Message, names: Names) -> None:
        assert message.content_type == value

    return check


def routed(
    exchange: str | Callable[[Names], str], routing_key: Callable[[Names], str]
) -> Check:
    def check(message: Message, names: Names) -> None:
        expected = exchange if isinstance(exchange, str) else exchange(names)
        assert message.delivery_info["exchange"] == expected
        assert message.delivery_info["routing_key"] == routing_key(names)

    return check


def group_index(message: Message, names: Names) -> None:
    """Member ``ids[i]`` of the group carries ``group_index == i``."""
    assert message.headers["group_index"] == names.ids.index(message.headers["id"])


def local_eta(message: Message, names: Names) -> None:
    """The eta is written in the app's timezone (Europe/Paris is never at UTC+0)."""
    eta = dt.datetime.fromisoformat(message.headers["eta"])
    assert eta.utcoffset() != dt.timedelta(0)


def has_reply_to(message: Message, names: Names) -> None:
    assert message.properties["reply_to"]


def anchored_only(message: Message, names: Names) -> None:
    """Nothing more to check: the case's ``anchored`` headers are checked for both apps."""


def exchange_queues(names: Names) -> Mapping[str, Any]:
    """The default queue and a second one, both bound to a named direct exchange."""
    exchange = Exchange(names.exchange, type="direct")
    return {
        "task_queues": [
            Queue(names.queue, exchange, routing_key=names.queue),
            Queue(names.other, exchange, routing_key="fid.rk"),
        ]
    }


def topic_default_exchange(names: Names) -> Mapping[str, Any]:
    """Celery's default queue on a topic exchange (not the anonymous-exchange shortcut)."""
    return {
        "task_default_exchange": names.exchange,
        "task_default_exchange_type": "topic",
        "task_default_routing_key": "fid.default",
        "task_queues": [
            Queue(
                names.queue, Exchange(names.exchange, type="topic"), routing_key="fid.#"
            )
        ],
    }


def transient_exchange(names: Names) -> Mapping[str, Any]:
    """The delivery mode comes from the queue's exchange definition."""
    exchange = Exchange(names.exchange, type="direct", delivery_mode="transient")
    return {"task_queues": [Queue(names.queue, exchange, routing_key=names.queue)]}


def timezone_conf(names: Names) -> Mapping[str, Any]:
    return {"timezone": "Europe/Paris", "enable_utc": True}


CASES: list[Case] = [
    Case(
        "delay",
        lambda app, n: app.tasks["fid.work"].apply_async(task_id=n.task_id),
        both(header("task", "fid.work"), prop("correlation_id", lambda n: n.task_id)),
    ),
    Case(
        "args-kwargs-json-rich-types",
        call(RICH_ARGS, RICH_KWARGS),
        both(
            content_type("application/json"),
            decoded(lambda body, n: body[0] == list(RICH_ARGS)),
        ),
    ),
    Case(
        "task-protocol-1",
        call((1, "a"), {"k": RICH_ARGS[1]}),
        decoded(lambda body, n: body["id"] == n.task_id and body["args"] == [1, "a"]),
        conf=lambda n: {"task_protocol": 1},
    ),
    Case("send-task-by-name", send_task_by_name, header("task", "fid.remote")),
    Case(
        "serializer-pickle-conf",
        call(RICH_ARGS, RICH_KWARGS),
        content_type("application/x-python-serialize"),
        conf=lambda n: {"task_serializer": "pickle"},
    ),
    Case(
        "serializer-msgpack-option",
        call(
            (1, "two", [3.5]), {"k": {"n": None}}, lambda n: {"serializer": "msgpack"}
        ),
        content_type("application/x-msgpack"),
    ),
    Case(
        "serializer-yaml-conf",
        call((1, "two", [3.5]), {"k": {"n": None}}),
        content_type("application/x-yaml"),
        conf=lambda n: {"task_serializer": "yaml"},
    ),
    Case(
        "compression-gzip-conf",
        call(("x" * 500,)),
        header("compression", "application/x-gzip"),
        conf=lambda n: {"task_compression": "gzip"},
    ),
    Case(
        "compression-zlib-option-pickle",
        call(RICH_ARGS, {}, lambda n: {"compression": "zlib", "serializer": "pickle"}),
        both(
            header("compression", "application/x-gzip"),
            content_type("application/x-python-serialize"),
        ),
    ),
    Case(
        "compression-bzip2-option",
        call(("y" * 500,), {}, lambda n: {"compression": "bzip2"}),
        header("compression", "application/x-bz2"),
    ),
    Case(
        "compression-lzma-msgpack-conf",
        call(("z" * 500,)),
        both(
            header("compression", "application/x-lzma"),
            content_type("application/x-msgpack"),
        ),
        conf=lambda n: {"task_compression": "lzma", "task_serializer": "msgpack"},
    ),
    Case("priority", call((1,), {}, lambda n: {"priority": 7}), prop("priority", 7)),
    Case(
        "priority-default-conf",
        call((1,)),
        prop("priority", 3),
        conf=lambda n: {"task_default_priority": 3},
    ),
    Case(
        "countdown",
        call((1,), {}, lambda n: {"countdown": 30}),
        anchored_only,
        anchored={"eta": 30},
    ),
    Case(
        "countdown-local-timezone",
        call((1,), {}, lambda n: {"countdown": 45.5}),
        local_eta,
        conf=timezone_conf,
        anchored={"eta": 45.5},
    ),
    Case("eta", call((1,), {}, lambda n: {"eta": ETA}), header("eta", ETA.isoformat())),
    Case(
        "expires-relative",
        call((1,), {}, lambda n: {"expires": 60}),
        prop("expiration", "60000"),
        anchored={"expires": 60},
    ),
    Case(
        "expires-absolute",
        call((1,), {}, lambda n: {"expires": EXPIRES_AT}),
        header("expires", EXPIRES_AT.isoformat()),
        expiration_until=EXPIRES_AT,
    ),
    Case(
        "countdown-and-expires-relative",
        call((1,), {}, lambda n: {"countdown": 10, "expires": 120.25}),
        prop("expiration", "120250"),
        anchored={"eta": 10, "expires": 120.25},
    ),
    Case(
        "explicit-queue",
        call((1,), {}, lambda n: {"queue": n.other}),
        routed("", lambda n: n.other),
        queue=lambda n: n.other,
    ),
    Case(
        "explicit-exchange-routing-key",
        call((1,), {}, lambda n: {"exchange": n.exchange, "routing_key": "fid.rk"}),
        routed(lambda n: n.exchange, lambda n: "fid.rk"),
        conf=exchange_queues,
        queue=lambda n: n.other,
    ),
    Case(
        "task-queues-named-exchange",
        call((1,)),
        # Celery publishes to a direct exchange's queue through the default exchange.
        routed("", lambda n: n.queue),
        conf=exchange_queues,
    ),
    Case(
        "task-routes",
        call((1,)),
        routed("", lambda n: n.other),
        conf=lambda n: {"task_routes": {"fid.*": {"queue": n.other}}},
        queue=lambda n: n.other,
    ),
    Case(
        "task-routes-exchange",
        call((1,)),
        routed(lambda n: n.exchange, lambda n: "fid.rk"),
        conf=lambda n: {
            **exchange_queues(n),
            "task_routes": {
                "fid.work": {"exchange": n.exchange, "routing_key": "fid.rk"}
            },
        },
        queue=lambda n: n.other,
    ),
    Case(
        "exchange-object-option",
        call(
            (1,),
            {},
            lambda n: {
                "exchange": Exchange(n.exchange, type="direct"),
                "routing_key": "fid.rk",
            },
        ),
        routed(lambda n: n.exchange, lambda n: "fid.rk"),
        conf=exchange_queues,
        queue=lambda n: n.other,
    ),
    Case(
        "topic-default-exchange",
        call((1,)),
        routed(lambda n: n.exchange, lambda n: "fid.#"),  # the queue's binding key
        conf=topic_default_exchange,
    ),
    Case(
        "custom-headers",
        call((1,), {}, lambda n: {"headers": {"x-tenant": "acme", "x-n": 3}}),
        both(header("x-tenant", "acme"), header("x-n", 3)),
    ),
    Case(
        "reply-to",
        call((1,), {}, lambda n: {"reply_to": "fid-reply"}),
        prop("reply_to", "fid-reply"),
    ),
    Case("retries", call((1,), {}, lambda n: {"retries": 3}), header("retries", 3)),
    Case(
        "shadow",
        call((1,), {}, lambda n: {"shadow": "fid.shadowed"}),
        header("shadow", "fid.shadowed"),
    ),
    Case(
        "time-limits",
        call((1,), {}, lambda n: {"time_limit": 10, "soft_time_limit": 5}),
        header("timelimit", [10, 5]),
    ),
    Case(
        "delivery-mode-transient",
        call((1,), {}, lambda n: {"delivery_mode": "transient"}),
        prop("delivery_mode", 1),
    ),
    Case(
        "delivery-mode-transient-conf",
        call((1,)),
        prop("delivery_mode", 1),
        conf=lambda n: {"task_default_delivery_mode": "transient"},
    ),
    Case(
        "task-send-sent-event",
        call((1,)),
        header("task", "fid.work"),
        # The task-sent event is not stored (it would announce a publish that has not
        # happened); the task message itself must be unchanged.
        conf=lambda n: {"task_send_sent_event": True},
    ),
    Case(
        "ignore-result",
        call((1,), {}, lambda n: {"ignore_result": True}),
        header("ignore_result", True),
    ),
    Case(
        "group",
        send_group,
        both(header("group", lambda n: n.ids[3]), group_index),
        count=2,
    ),
    Case(
        "chain",
        send_chain,
        decoded(
            lambda body, n: (
                [s["options"]["task_id"] for s in body[2]["chain"]]
                == [n.ids[2], n.ids[1]]
            )
        ),
    ),
    Case(
        "link-and-link-error",
        send_with_links,
        decoded(
            lambda body, n: (
                len(body[2]["callbacks"]) == 1 and len(body[2]["errbacks"]) == 2
            )
        ),
    ),
    Case(
        "lineage-from-running-task",
        send_from_running_task,
        both(
            header("parent_id", lambda n: n.ids[1]),
            header("root_id", root_of_running_task),
        ),
    ),
    Case(
        "lineage-inherit-parent-priority",
        send_from_running_task,
        both(header("parent_id", lambda n: n.ids[1]), prop("priority", 5)),
        conf=lambda n: {"task_inherit_parent_priority": True},
    ),
    # Redis: kombu's virtual transport, published by the relay's KombuPublisher.
    Case(
        "redis-delay",
        call((1, "a"), {"b": RICH_ARGS[1]}),
        header("task", "fid.work"),
        broker="redis",
    ),
    Case(
        "redis-priority",
        call((1,), {}, lambda n: {"priority": 6}),
        prop("priority", 6),
        broker="redis",
    ),
    Case(
        "redis-countdown-expires",
        call((1,), {}, lambda n: {"countdown": 20, "expires": 90}),
        prop("expiration", "90000"),
        broker="redis",
        anchored={"eta": 20, "expires": 90},
    ),
    Case(
        "redis-pickle-bzip2",
        call(RICH_ARGS, RICH_KWARGS),
        header("compression", "application/x-bz2"),
        conf=lambda n: {"task_serializer": "pickle", "task_compression": "bzip2"},
        broker="redis",
    ),
    Case(
        "redis-exchange-routing-key",
        call((1,), {}, lambda n: {"exchange": n.exchange, "routing_key": "fid.rk"}),
        routed(lambda n: n.exchange, lambda n: "fid.rk"),
        conf=exchange_queues,
        queue=lambda n: n.other,
        broker="redis",
    ),
    Case(
        "redis-group",
        send_group,
        header("group", lambda n: n.ids[3]),
        count=2,
        broker="redis",
    ),
    Case(
        "redis-lineage",
        send_from_running_task,
        both(
            header("parent_id", lambda n: n.ids[1]),
            header("root_id", root_of_running_task),
        ),
        broker="redis",
    ),
]


# -- the two apps ------------------------------------------------------------------


def register_tasks(app: Celery) -> None:
    """The same task names on both apps."""

    @app.task(name="fid.work", shared=False)
    def work(*args: Any, **kwargs: Any) -> None:
        return None

    @app.task(name="fid.parent", bind=True, shared=False)
    def parent(self: Any, child_id: str) -> None:
        with transaction.atomic():
            self.app.tasks["fid.work"].apply_async((1,), task_id=child_id)

    @app.task(name="fid.root", bind=True, shared=False)
    def root(self: Any, child_id: str, parent_id: str) -> None:
        self.app.tasks["fid.parent"].apply(
            args=(child_id,), task_id=parent_id, priority=5, throw=True
        )


def configure(app: Celery, case: Case, names: Names) -> Celery:
    app.conf.update(
        {
            "broker_url": BROKERS[case.broker],
            "task_default_queue": names.queue,
            "result_backend": None,
            **case.conf(names),
        }
    )
    register_tasks(app)
    return app


@contextmanager
def app_pair(case: Case, names: Names) -> Iterator[tuple[Celery, OutboxCelery]]:
    """A plain app and an outbox app with the same configuration, queues declared."""
    plain = configure(Celery("fidelity", set_as_current=False), case, names)
    outbox = configure(OutboxCelery("fidelity", set_as_current=False), case, names)
    try:
        # What a worker does at startup: declare every configured queue and binding.
        with plain.connection_for_write() as conn:
            channel = conn.default_channel
            for queue in plain.amqp.queues.values():
                queue(channel).declare()
        yield plain, outbox
    finally:
        plain.close()
        outbox.close()
        # Other tests find "the" OutboxCelery through this registry; this one must go.
        outbox_app_module._instances.discard(outbox)
        # rpc:// declares a reply queue named after each app's thread_oid.
        replies = (plain.thread_oid, outbox.thread_oid)
        delete_broker_names(BROKERS[case.broker], names, replies)
        del plain, outbox
        gc.collect()


def delete_broker_names(url: str, names: Names, extra_queues: tuple[str, ...]) -> None:
    if url.startswith("redis://"):
        import redis

        client = redis.Redis.from_url(url)
        try:
            keys = list(client.scan_iter(match=f"*{names.queue}*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
        return
    with Connection(url, connect_timeout=5) as conn:
        for queue in (names.queue, names.other, *extra_queues):
            conn.default_channel.queue_delete(queue)
        for exchange in (names.queue, names.other, names.exchange):
            conn.default_channel.exchange_delete(exchange)


# -- the broker side ---------------------------------------------------------------


def receive(
    url: str, queue_name: str, count: int, timeout: float = 10.0
) -> list[Message]:
    """Exactly ``count`` raw messages from ``queue_name``, sorted by task id."""
    received: list[Message] = []
    with Connection(url, connect_timeout=5) as conn:
        queue = Queue(queue_name, no_declare=True)(conn.default_channel)
        deadline = time.monotonic() + timeout
        while len(received) < count:
            message = queue.get(no_ack=True)
            if message is None:
                assert time.monotonic() < deadline, (
                    f"{len(received)} of {count} messages arrived in {queue_name!r}"
                )
                time.sleep(0.02)
                continue
            received.append(message)
        assert queue.get(no_ack=True) is None, (
            f"more than {count} messages in {queue_name!r}"
        )
    return sorted(received, key=lambda m: str(m.headers.get("id", "")))


def relay_once(app: OutboxCelery, expected_rows: int) -> None:
    """One real relay cycle: claim the committed rows, publish them, settle."""
    settings = get_settings()
    stores = outbox_stores(settings)
    operator = stores.operator()
    before = operator.stats()
    assert before.pending == expected_rows, "the call did not go through the outbox"
    if before.scheduled:
        # An ETA beyond CELERY_OUTBOX_SCHEDULE_AFTER waits in the outbox: made due
        # now, as its ETA coming would, the relay publishes Celery's message of the call.
        assert stores.relay().claim(expected_rows, 30).messages == ()
        operator.retry_now(
            list(OutboxMessage.objects.using(stores.alias).values_list("id", flat=True))
        )
    publisher = build_publisher(app, settings)
    relay = Relay(
        stores.relay(), publisher, RelayConfig.from_settings(settings, until_empty=True)
    )
    try:
        assert relay.run_once() is Turn.PARTIAL
    finally:
        publisher.close()
    stats = stores.operator().stats()
    assert (stats.pending, stats.dead) == (0, 0), f"the relay did not publish: {stats}"


@dataclass(frozen=True)
class Window:
    """When a call started and ended (UTC)."""

    start: dt.datetime
    end: dt.datetime

    def contains(self, value: dt.datetime, offset_seconds: float) -> bool:
        offset = dt.timedelta(seconds=offset_seconds)
        return self.start + offset - SLACK <= value <= self.end + offset + SLACK


def timed(action: Callable[[], None]) -> Window:
    start = dt.datetime.now(dt.timezone.utc)
    action()
    return Window(start, dt.datetime.now(dt.timezone.utc))


# -- the comparison ----------------------------------------------------------------

#: Properties that are not part of a publish: the delivery tag (Redis: a fresh uuid), and
#: py-amqp's copy of the headers, which are compared on their own.
PER_DELIVERY = ("delivery_tag", "application_headers")


def properties_of(message: Message) -> dict[str, Any]:
    properties = dict(message.properties)
    for name in PER_DELIVERY:
        properties.pop(name, None)
    return properties


def same_body(
    actual: Message, outbox_app: Celery, expected: Message, plain_app: Celery
) -> bool:
    """Same bytes, up to each app's ``thread_oid``, the ``reply_to`` canvas embeds in options."""
    actual_body, expected_body = raw_body(actual), raw_body(expected)
    if actual_body == expected_body:
        return True
    if "compression" in actual.headers:
        return False
    outbox_oid, plain_oid = (
        outbox_app.thread_oid.encode(),
        plain_app.thread_oid.encode(),
    )
    return (
        outbox_oid in actual_body
        and plain_oid not in actual_body
        and actual_body.replace(outbox_oid, plain_oid) == expected_body
    )


def raw_body(message: Message) -> bytes:
    """The body as bytes (py-amqp hands text bodies over already decoded)."""
    body = message.body
    if isinstance(body, str):
        return body.encode(message.content_encoding or "utf-8")
    return bytes(body)


def assert_same_message(
    case: Case,
    plain: tuple[Celery, Message, Window],
    outbox: tuple[Celery, Message, Window],
) -> None:
    """Field by field; the only allowed differences are the documented ones."""
    plain_app, expected, plain_window = plain
    outbox_app, actual, outbox_window = outbox

    assert actual.content_type == expected.content_type
    assert actual.content_encoding == expected.content_encoding
    assert same_body(actual, outbox_app, expected, plain_app)
    for key in ("exchange", "routing_key"):
        assert actual.delivery_info[key] == expected.delivery_info[key], key

    expected_headers, actual_headers = dict(expected.headers), dict(actual.headers)
    for name, seconds in case.anchored.items():
        plain_value = dt.datetime.fromisoformat(expected_headers.pop(name))
        outbox_value = dt.datetime.fromisoformat(actual_headers.pop(name))
        assert plain_window.contains(plain_value, seconds), (
            name,
            plain_value,
            plain_window,
        )
        assert outbox_window.contains(outbox_value, seconds), (
            f"outbox {name}={outbox_value} is not anchored at call time {outbox_window}"
        )
        assert outbox_value.utcoffset() == plain_value.utcoffset(), name
    assert actual_headers == expected_headers

    expected_props, actual_props = properties_of(expected), properties_of(actual)
    plain_reply, outbox_reply = (
        expected_props.pop("reply_to"),
        actual_props.pop("reply_to"),
    )
    if plain_reply == plain_app.thread_oid:
        assert outbox_reply == outbox_app.thread_oid
    else:
        assert outbox_reply == plain_reply
    if case.expiration_until is not None:
        for window, value in (
            (plain_window, expected_props.pop("expiration")),
            (outbox_window, actual_props.pop("expiration")),
        ):
            ttl = dt.timedelta(milliseconds=int(value))
            assert window.contains(case.expiration_until - ttl, 0), (value, window)
    assert actual_props == expected_props


def send_both(
    case: Case, names: Names, plain: Celery, outbox: OutboxCelery
) -> tuple[list[Message], list[Message]]:
    """The call on both apps; compare what reaches the broker. Returns both messages."""
    url, queue = BROKERS[case.broker], case.queue(names)

    plain_window = timed(lambda: case.send(plain, names))
    expected = receive(url, queue, case.count)

    def enqueue() -> None:
        with transaction.atomic():
            case.send(outbox, names)

    outbox_window = timed(enqueue)
    if case.anchored or case.expiration_until is not None:
        time.sleep(RELAY_DELAY)
    relay_once(outbox, case.count)
    actual = receive(url, queue, case.count)

    for plain_message, outbox_message in zip(expected, actual, strict=True):
        case.check(plain_message, names)
        assert_same_message(
            case,
            (plain, plain_message, plain_window),
            (outbox, outbox_message, outbox_window),
        )
    return expected, actual


def case_params() -> list[Any]:
    return [
        pytest.param(
            case,
            id=case.id,
            marks=[pytest.mark.xfail(strict=True, reason=case.known_bug)]
            if case.known_bug
            else [],
        )
        for case in CASES
    ]


@pytest.mark.parametrize("case", case_params())
def test_outbox_message_equals_plain_celery_message(case: Case) -> None:
    names = Names.new()
    with app_pair(case, names) as (plain, outbox):
        send_both(case, names, plain, outbox)


class _RolledBack(Exception):
    pass


@pytest.mark.parametrize("case", case_params())
def test_a_repeated_call_equals_plain_celery_message_too(case: Case) -> None:
    """The same table, after the outbox app has sent the call once (rolled back).

    Nothing an earlier call left behind (a cached route, a memo of the
    configuration) may change the next message.
    """
    names = Names.new()
    earlier = dataclasses.replace(
        names, ids=tuple(str(uuid.uuid4()) for _ in names.ids)
    )
    with app_pair(case, names) as (plain, outbox):
        with contextlib.suppress(_RolledBack), transaction.atomic():
            case.send(outbox, earlier)
            raise _RolledBack
        send_both(case, names, plain, outbox)


# -- publish signals -------------------------------------------------------------


def test_publish_signals_see_the_same_message_and_their_headers_reach_the_broker() -> (
    None
):
    """before/after_task_publish fire for an outbox enqueue with the plain app's arguments.

    A header a ``before_task_publish`` receiver adds is stored with the row and
    reaches the broker. (Through the outbox, ``after_task_publish`` fires at enqueue,
    when the message is handed over, as it does for a plain publish.)
    """
    names = Names.new()
    case = Case(
        "signals",
        call(
            (1, "a"), {"k": RICH_ARGS[2]}, lambda n: {"priority": 4, "queue": n.other}
        ),
        header("x-signal", "added"),
        queue=lambda n: n.other,
    )
    before: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []

    def on_before(
        sender: str,
        body: Any,
        exchange: str,
        routing_key: str,
        headers: dict[str, Any],
        properties: dict[str, Any],
        declare: list[Queue],
        retry_policy: dict[str, Any],
        **extra: Any,
    ) -> None:
        if headers.get("id") != names.task_id:
            return
        before.append(
            copy.deepcopy(
                {
                    "sender": sender,
                    "body": body,
                    "exchange": exchange,
                    "routing_key": routing_key,
                    "headers": headers,
                    "properties": properties,
                    "declare": [queue.name for queue in declare],
                    "retry_policy": retry_policy,
                }
            )
        )
        headers["x-signal"] = "added"

    def on_after(
        sender: str,
        body: Any,
        exchange: str,
        routing_key: str,
        headers: dict[str, Any],
        **extra: Any,
    ) -> None:
        if headers.get("id") != names.task_id:
            return
        after.append(
            copy.deepcopy(
                {
                    "sender": sender,
                    "body": body,
                    "exchange": exchange,
                    "routing_key": routing_key,
                    "headers": headers,
                }
            )
        )

    signals.before_task_publish.connect(on_before, weak=False)
    signals.after_task_publish.connect(on_after, weak=False)
    try:
        with app_pair(case, names) as (plain, outbox):
            _, actual = send_both(case, names, plain, outbox)
            plain_oid, outbox_oid = plain.thread_oid, outbox.thread_oid
    finally:
        signals.before_task_publish.disconnect(on_before)
        signals.after_task_publish.disconnect(on_after)

    assert actual[0].headers["x-signal"] == "added"
    assert len(before) == 2, "before_task_publish did not fire once per app"
    assert len(after) == 2, "after_task_publish did not fire once per app"
    plain_before, outbox_before = before
    assert plain_before["properties"].pop("reply_to") == plain_oid
    assert outbox_before["properties"].pop("reply_to") == outbox_oid
    assert plain_before["sender"] == "fid.work"
    assert plain_before["declare"] == [names.other]
    assert plain_before["properties"]["priority"] == 4
    assert outbox_before == plain_before
    plain_after, outbox_after = after
    assert plain_after["headers"]["x-signal"] == "added"
    assert outbox_after == plain_after
