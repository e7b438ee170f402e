"""Celery's ``task-sent`` event: the relay sends it for each message it publishes.

A plain ``celery.Celery`` and an ``OutboxCelery`` with the same configuration, both
with ``task_send_sent_event`` on, make the same calls on RabbitMQ. A real event
receiver (``app.events.Receiver``) collects every ``task-sent`` event: the plain app's
come from its publishes, the outbox app's from a real relay cycle. Each outbox event
must carry the fields of the plain one, field for field; only the sender's own
``hostname``, ``pid``, ``clock``, ``timestamp`` and ``utcoffset`` (and the task id)
differ, and the ETA and expiry are each anchored at their own call.
"""

from __future__ import annotations

import datetime as dt
import gc
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from django.db import transaction
from kombu import Connection

from celery_outbox import OutboxCelery
from celery_outbox import app as outbox_app_module
from celery_outbox.broker import build_publisher
from celery_outbox.conf import get_settings
from celery_outbox.engine.loop import Turn
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.sent import sent_event_observers
from celery_outbox.store import outbox_stores

from ..conftest import BROKER_AMQP

pytestmark = pytest.mark.django_db(transaction=True)

#: Sent by each process on its own.
PER_SENDER = {"hostname", "pid", "clock", "timestamp", "utcoffset", "local_received"}
#: Computed from the clock at each call (a countdown, a relative expiry).
ANCHORED = ("eta", "expires")

Call = Callable[[Celery, str], None]


def plain_call(app: Celery, task_id: str) -> None:
    app.send_task("shop.add", args=(1, 2), kwargs={"tag": "x"}, task_id=task_id)


def later_call(app: Celery, task_id: str) -> None:
    app.send_task("shop.add", args=(2, 3), task_id=task_id, countdown=5, expires=120)


def routed_call(app: Celery, task_id: str) -> None:
    app.send_task(
        "shop.record",
        args=("routed",),
        task_id=task_id,
        queue=f"{app.conf.task_default_queue}-other",
    )


def lineage_call(app: Celery, task_id: str) -> None:
    app.send_task(
        "shop.record",
        args=("child",),
        task_id=task_id,
        parent_id="the-parent",
        root_id="the-root",
        retries=2,
    )


CALLS = {
    "plain": plain_call,
    "countdown-expires": later_call,
    "queue": routed_call,
    "lineage": lineage_call,
}


class SentEvents:
    """A real event receiver on a thread, keeping the ``task-sent`` events of our ids."""

    def __init__(self, app: Celery, wanted: set[str]) -> None:
        self.app, self.wanted = app, wanted
        self.events: dict[str, dict[str, Any]] = {}
        #: How many ``task-sent`` events each wanted id had.
        self.counts: Counter[str] = Counter()
        self._connection = Connection(BROKER_AMQP, connect_timeout=5)
        self.ready = threading.Event()
        ready = self.ready

        class Receiver(app.events.Receiver):  # type: ignore[misc,name-defined]
            def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
                # kombu's ConsumerMixin hook: the queue is bound, events arrive.
                super().on_consume_ready(*args, **kwargs)
                ready.set()

        self.receiver = Receiver(self._connection, handlers={"task-sent": self._keep})
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _keep(self, event: dict[str, Any]) -> None:
        if event.get("uuid") in self.wanted:
            self.events[str(event["uuid"])] = event
            self.counts[str(event["uuid"])] += 1

    def _run(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> None:
        self._thread.start()
        assert self.ready.wait(10), "the event receiver never started"

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self.receiver.should_stop = True
        self._thread.join(5)
        self._connection.release()


@contextmanager
def app_pair(queue: str) -> Iterator[tuple[Celery, OutboxCelery]]:
    def configure(app: Celery) -> Celery:
        app.conf.update(
            broker_url=BROKER_AMQP,
            task_default_queue=queue,
            result_backend=None,
            task_send_sent_event=True,
        )
        return app

    plain = configure(Celery("sent", set_as_current=False))
    outbox = configure(OutboxCelery("sent", set_as_current=False))
    try:
        yield plain, outbox
    finally:
        plain.close()
        outbox.close()
        outbox_app_module._instances.discard(outbox)
        with Connection(BROKER_AMQP, connect_timeout=5) as conn:
            for name in (queue, f"{queue}-other"):
                conn.default_channel.queue_delete(name)
        del plain, outbox
        gc.collect()


def relay_once(app: OutboxCelery, count: int) -> None:
    """A real relay cycle with the observers ``outbox relay`` gives it for this app."""
    settings = get_settings()
    stores = outbox_stores(settings)
    operator = stores.operator()
    assert operator.stats().pending == count
    publisher = build_publisher(app, settings)
    relay = Relay(
        stores.relay(),
        publisher,
        RelayConfig.from_settings(settings, until_empty=True),
        observers=sent_event_observers(app),
    )
    try:
        assert relay.run_once() is Turn.PARTIAL
    finally:
        publisher.close()
    assert operator.stats().pending == 0


def moment(value: str, call_window: tuple[float, float], seconds: float) -> None:
    """An ISO time ``seconds`` after some moment of the call."""
    at = dt.datetime.fromisoformat(value).timestamp()
    start, end = call_window
    assert start + seconds - 1 <= at <= end + seconds + 1, (value, call_window)


def test_the_relay_sends_the_task_sent_event_stock_celery_sends() -> None:
    queue = f"sent-{uuid.uuid4().hex[:8]}"
    plain_ids = {name: f"plain-{name}-{uuid.uuid4()}" for name in CALLS}
    outbox_ids = {name: f"outbox-{name}-{uuid.uuid4()}" for name in CALLS}
    with app_pair(queue) as (plain, outbox):
        events = SentEvents(plain, {*plain_ids.values(), *outbox_ids.values()})
        events.start()
        try:
            windows: dict[str, tuple[float, float]] = {}
            for name, call in CALLS.items():
                start = time.time()
                call(plain, plain_ids[name])
                windows[f"plain-{name}"] = (start, time.time())
            with transaction.atomic():
                for name, call in CALLS.items():
                    start = time.time()
                    call(outbox, outbox_ids[name])
                    windows[f"outbox-{name}"] = (start, time.time())
            # Nothing at the call: the event announces a publish.
            events.wait_for(len(CALLS))
            assert set(events.events) == set(plain_ids.values())
            relay_once(outbox, len(CALLS))
            events.wait_for(2 * len(CALLS))
        finally:
            events.stop()

    for name in CALLS:
        expected = dict(events.events[plain_ids[name]])
        actual = dict(events.events[outbox_ids[name]])
        for field in ANCHORED:
            if expected[field] is None:
                assert actual[field] is None, field
                continue
            seconds = {"eta": 5, "expires": 120}[field]
            moment(expected.pop(field), windows[f"plain-{name}"], seconds)
            moment(actual.pop(field), windows[f"outbox-{name}"], seconds)
        for kept, ids in ((expected, plain_ids), (actual, outbox_ids)):
            assert kept.pop("uuid") == ids[name]
            if name != "lineage":
                assert kept.pop("root_id") == ids[name]  # its own id, when none given
            for field in PER_SENDER:
                kept.pop(field, None)
        assert actual == expected, name
        assert actual["type"] == "task-sent"


def test_no_event_unless_the_app_asks_for_it() -> None:
    outbox = OutboxCelery("quiet", set_as_current=False)
    try:
        assert sent_event_observers(outbox) == []
        outbox.conf.task_send_sent_event = True
        assert len(sent_event_observers(outbox)) == 1
    finally:
        outbox.close()
        outbox_app_module._instances.discard(outbox)


def test_a_strict_head_published_again_sends_no_second_event(settings: Any) -> None:
    # No worker: the head's running lease ends, and the relay publishes it again.
    settings.CELERY_OUTBOX_STRICT_LEASE_SECONDS = 0.2
    queue = f"sent-{uuid.uuid4().hex[:8]}"
    task_id, marker = f"strict-{uuid.uuid4()}", f"marker-{uuid.uuid4()}"
    with app_pair(queue) as (plain, outbox):
        events = SentEvents(plain, {task_id, marker})
        events.start()
        try:
            with transaction.atomic():
                outbox.send_task(
                    "shop.record",
                    args=("strict",),
                    task_id=task_id,
                    ordering_key="K",
                    ordering="strict",
                )
            assert publish_times(outbox, 3) == 3  # the first and two after the lease
            # Sent after the relay's: once it is in, theirs are too.
            plain_call(plain, marker)
            events.wait_for(2)
        finally:
            events.stop()
    assert events.counts == {task_id: 1, marker: 1}


def publish_times(app: OutboxCelery, wanted: int, timeout: float = 10.0) -> int:
    """Run relay cycles until ``wanted`` of them published (or ``timeout``); how many did."""
    settings = get_settings()
    publisher = build_publisher(app, settings)
    relay = Relay(
        outbox_stores(settings).relay(),
        publisher,
        RelayConfig.from_settings(settings, until_empty=True),
        observers=sent_event_observers(app),
    )
    published = 0
    deadline = time.monotonic() + timeout
    try:
        while published < wanted and time.monotonic() < deadline:
            published += relay.run_once() is Turn.PARTIAL
            time.sleep(0.05)
    finally:
        publisher.close()
    return published
