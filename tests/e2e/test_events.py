"""Events end to end: a real relay, real workers of several services, on RabbitMQ
and on Redis.

Each service is its own Celery app (``tests/events_project``) with its own worker;
subscribers record what they ran in Redis (db 13). Retry steps are 1, 2 and 4 s: held by
RabbitMQ's TTL queues there, by delayed outbox rows on Redis.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.db import transaction
from django.test import override_settings
from kombu import Connection

from celery_outbox.conf import get_settings
from celery_outbox.events import archive
from celery_outbox.events.topology import ServiceTopology
from celery_outbox.models import DeadLetter, OutboxMessage
from tests.events_project.record import URL as RECORD_URL
from tests.project.shop.models import TaskRun

from ..integration.test_events import delete_topology, order_created_fixture  # noqa: F401
from .conftest import (
    BROKER_AMQP,
    BROKER_REDIS,
    REPO_ROOT,
    WORKER_HEARTBEAT,
    Proc,
    Stack,
    wait_until,
)

STEPS = 3
SERVICES = ["billing", "shipping", "audit", "ledger"]


class Events:
    """A stack whose workers are event services, on an exchange of this test only."""

    def __init__(self, stack: Stack, exchange: str) -> None:
        self.stack = stack
        self.exchange = exchange
        self.on_redis = stack.broker.startswith("redis://")
        self.redis = redis.Redis.from_url(RECORD_URL)
        stack.env.update(
            DJANGO_SETTINGS_MODULE="tests.events_project.settings",
            OUTBOX_TEST_EVENTS_EXCHANGE=exchange,
            OUTBOX_TEST_EVENTS_RETRIES=str(STEPS),
        )

    def start_service(
        self,
        service: str,
        *,
        pool: str = "threads",
        concurrency: int = 4,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """A worker of ``service`` on its queue; ``env`` adds to the stack's. With the
        project's worker's AMQP heartbeat: it acts on SIGTERM within half of it, not
        after up to 10 s of an idle connection (the stack's stop waited for that)."""
        args = [
            sys.executable, "-m", "celery", "-A", f"tests.events_project.{service}",
            "worker", "--pool", pool, "--concurrency", str(concurrency),
            "-Q", f"{self.exchange}:{service}:tasks",
            "--hostname", f"{service}-{uuid.uuid4().hex[:6]}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
            "-l", "warning",
        ]  # fmt: skip
        environ = dict(self.stack.env, **(env or {}))
        environ["OUTBOX_TEST_BROKER_HEARTBEAT"] = str(WORKER_HEARTBEAT)
        proc = self.stack._spawn(service, args, env=environ)
        proc.wait_for_output(f"events: service {service} consumes")
        return proc

    def records(self, service: str, phase: str) -> list[dict[str, Any]]:
        raw = self.redis.lrange(f"{self.exchange}:{service}:handled", 0, -1)
        rows = [json.loads(item) for item in raw]
        return [row for row in rows if row["phase"] == phase]

    def set_failures(self, service: str, count: int) -> None:
        self.redis.set(f"{self.exchange}:{service}:handled:failures", count)

    def set_flag(self, service: str, name: str, on: bool) -> None:
        key = f"{self.exchange}:{service}:handled:{name}"
        self.redis.set(key, 1) if on else self.redis.delete(key)

    def command(self, *args: str) -> str:
        return self.outbox("events", *args)

    def outbox(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", "outbox", *args],
            cwd=REPO_ROOT, env=self.stack.env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + done.stdout
        return done.stdout

    def archived(self, topology: ServiceTopology) -> int:
        """Events in the service's archive: its archive queue, or on Redis the
        outbox's dead letters routed to its queues."""
        if self.on_redis:
            prefix = f"{topology.prefix}:"
            return int(
                DeadLetter.objects.filter(routing_key__startswith=prefix).count()
            )
        with Connection(BROKER_AMQP, connect_timeout=5) as connection:
            return int(archive.count(connection, topology))

    def cleanup(self) -> None:
        for key in self.redis.scan_iter(f"{self.exchange}:*"):
            self.redis.delete(key)
        if self.on_redis:
            broker = redis.Redis.from_url(BROKER_REDIS)
            for pattern in (f"{self.exchange}*", f"_kombu.binding*{self.exchange}*"):
                for key in broker.scan_iter(pattern):
                    broker.delete(key)
            broker.close()
            return
        delete_topology(self.exchange, SERVICES, STEPS)
        with Connection(BROKER_AMQP, connect_timeout=5) as connection:
            channel = connection.channel()
            for service in SERVICES:
                channel.queue_delete(f"{self.exchange}:{service}:tasks")
                channel.exchange_delete(f"{self.exchange}:{service}:tasks")
            channel.close()


@pytest.fixture
def broker() -> str:
    """The broker of the stack; tests that run on both parametrize it."""
    return BROKER_AMQP


BOTH_BROKERS = pytest.mark.parametrize(
    "broker", [BROKER_AMQP, BROKER_REDIS], ids=["rabbitmq", "redis"]
)


@contextlib.contextmanager
def event_stack(
    e2e: Callable[..., Stack], broker: str, prefix: str = "test-events"
) -> Iterator[Events]:
    """A stack on ``broker`` whose workers are event services, on an exchange of its
    own; its queues, exchanges and records are deleted afterwards."""
    exchange = f"{prefix}-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=exchange, CELERY_OUTBOX_EVENTS_MAX_RETRIES=STEPS
    ):
        stack = e2e(broker=broker)
        helper = Events(stack, exchange)
        try:
            yield helper
        finally:
            stack.stop_all()
            helper.cleanup()


@pytest.fixture
def events(e2e: Callable[..., Stack], broker: str) -> Iterator[Events]:
    with event_stack(e2e, broker) as helper:
        yield helper


def fire(event: Any, numbers: range, rollback_every: int = 0) -> set[int]:
    committed = set()
    for number in numbers:
        with transaction.atomic():
            event(number, "9.90")
            if rollback_every and number % rollback_every == 0:
                transaction.set_rollback(True)
                continue
        committed.add(number)
    return committed


@BOTH_BROKERS
def test_two_services_each_handle_every_committed_event_once(
    events: Events, order_created: Any
) -> None:
    events.start_service("billing")
    events.start_service("shipping")
    events.stack.start_relay()
    started = time.monotonic()
    committed = fire(order_created, range(1000), rollback_every=5)
    fired = time.monotonic()
    assert len(committed) == 800
    wait_until(lambda: not OutboxMessage.objects.exists(), 120, "the relay to drain")
    drained = time.monotonic()
    for service in ("billing", "shipping"):
        done = functools.partial(events.records, service, "done")
        wait_until(
            lambda: len(done()) >= 800, 150,  # noqa: B023 (used in this iteration)
            f"{service} to handle 800 events", lambda: str(len(done())),  # noqa: B023
        )  # fmt: skip
    handled = time.monotonic()
    time.sleep(2)  # anything extra (a duplicate, a rolled-back event) would show now
    for service in ("billing", "shipping"):
        numbers = [row["payload"] for row in events.records(service, "done")]
        assert sorted(numbers) == sorted(committed), service
    print(
        f"\n{'redis' if events.on_redis else 'rabbitmq'}: fired 1000 (800 committed) in {fired - started:.1f} s; relay published "
        f"all by {drained - started:.1f} s; both services "
        f"handled all in {handled - started:.1f} s "
        f"({1600 / (handled - started):.0f} handled/s end to end)"
    )
    # A service started later gets only what is fired after its queue exists.
    events.start_service("audit")
    later = fire(order_created, range(5000, 5010))
    wait_until(lambda: len(events.records("audit", "done")) >= 10, 60, "audit")
    time.sleep(1)
    assert sorted(row["payload"] for row in events.records("audit", "done")) == sorted(
        later
    )
    events.stack.assert_alive()


@BOTH_BROKERS
def test_failing_subscriber_is_retried_at_1_2_4_s_then_archived_and_replayed(
    events: Events, order_created: Any
) -> None:
    events.set_flag("billing", "fail", True)
    events.start_service("billing")
    events.stack.start_relay()
    fire(order_created, range(1, 2))
    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    wait_until(
        lambda: events.archived(topology) == 1, 60, "the archived event",
        lambda: str(events.records("billing", "start")),
    )  # fmt: skip
    starts = [row["at"] for row in events.records("billing", "start")]
    assert len(starts) == 1 + STEPS
    delays = [later - earlier for earlier, later in itertools.pairwise(starts)]
    errors = [delay - 2**step for step, delay in enumerate(delays)]
    print(
        f"\n{'redis' if events.on_redis else 'rabbitmq'}: retry delays "
        f"{[round(d, 2) for d in delays]} for steps 1, 2, 4 s "
        f"(errors {[round(e, 3) for e in errors]} s)"
    )
    for step, delay in enumerate(delays):
        expected = 2**step
        assert abs(delay - expected) <= max(0.1 * expected, 0.5), delays
    assert "retries=3" in events.command(
        "--app", "tests.events_project.billing.app", "inspect"
    )
    events.set_flag("billing", "fail", False)  # the fix is deployed
    if events.on_redis:
        # The archive is the outbox's dead letters: the usual replay reaches it.
        out = events.outbox("tasks", "replay", "--name", "celery_outbox.events.deliver")
    else:
        out = events.command(
            "--app", "tests.events_project.billing.app", "replay", "--all"
        )
    assert "replayed 1" in out.lower(), out
    wait_until(lambda: len(events.records("billing", "done")) == 1, 30, "the replay")
    time.sleep(1.5)
    assert [row["payload"] for row in events.records("billing", "done")] == [1]
    assert (
        events.command("--app", "tests.events_project.billing.app", "inspect").strip()
        == ""
    )


def test_a_worker_killed_mid_subscriber_gets_the_event_again(
    events: Events, order_created: Any
) -> None:
    events.set_flag("shipping", "slow", True)
    worker = events.start_service("shipping")
    events.stack.start_relay()
    fire(order_created, range(42, 43))
    wait_until(lambda: len(events.records("shipping", "start")) == 1, 60, "the start")
    os.killpg(worker.pid, signal.SIGKILL)
    worker.popen.wait(15)
    worker.long_running = False
    events.set_flag("shipping", "slow", False)
    events.start_service("shipping")
    wait_until(lambda: len(events.records("shipping", "done")) == 1, 60, "redelivery")
    assert [row["payload"] for row in events.records("shipping", "done")] == [42]


#: kombu's visibility timeout in the Redis kill test (a sweep for older unacknowledged
#: copies every second): shorter than the slow subscriber's 30 s.
VISIBILITY = "3"


@pytest.mark.parametrize("broker", [BROKER_REDIS], ids=["redis"])
def test_a_worker_killed_mid_subscriber_on_redis_gets_its_copy_back_after_the_visibility_timeout(
    events: Events, order_created: Any
) -> None:
    """Two services on Redis; shipping's worker is killed as a whole (its main
    process too) while its subscriber runs, after billing acknowledged its own copy.
    kombu puts shipping's copy back into shipping's list once it is older than the
    visibility timeout (whichever consumer of the broker's database sweeps first), and
    a new shipping worker runs it. Billing's acknowledgement must not take shipping's
    unacknowledged copy with it: each copy has its own delivery tag."""
    env = {"OUTBOX_TEST_VISIBILITY_TIMEOUT": VISIBILITY}
    events.set_flag("shipping", "slow", True)
    events.start_service("billing", env=env)
    shipping = events.start_service("shipping", env=env)
    events.stack.start_relay()
    fire(order_created, range(42, 43))
    wait_until(lambda: len(events.records("shipping", "start")) == 1, 60, "the start")
    wait_until(lambda: len(events.records("billing", "done")) == 1, 30, "billing")
    # Before the visibility timeout: a live worker's own sweep would put it back.
    os.killpg(shipping.pid, signal.SIGKILL)
    shipping.popen.wait(15)
    shipping.long_running = False
    events.set_flag("shipping", "slow", False)
    events.start_service("shipping", env=env)
    wait_until(
        lambda: len(events.records("shipping", "done")) == 1, 20, "shipping's copy back",
        lambda: str(events.records("shipping", "start")),
    )  # fmt: skip
    time.sleep(float(VISIBILITY) + 1)  # a second copy put back would have run by now
    assert [row["payload"] for row in events.records("shipping", "done")] == [42]
    for phase in ("start", "done"):
        assert [row["payload"] for row in events.records("billing", phase)] == [42]
    events.stack.assert_alive()


@BOTH_BROKERS
def test_a_subscriber_with_the_inbox_has_one_effect_per_event(
    events: Events, order_created: Any
) -> None:
    """The same event published twice: one effect. Failing twice, then succeeding:
    one effect (each failure rolled back its write with the inbox row)."""
    events.set_failures("ledger", 0)
    ledger = events.start_service("ledger")
    fire(order_created, range(7, 8))
    (row,) = OutboxMessage.objects.all()
    row.pk = None  # a second row of the same message: a duplicate publish
    row.save()
    events.stack.start_relay()
    wait_until(lambda: len(events.records("ledger", "done")) == 1, 60, "event 7")
    wait_until(lambda: not OutboxMessage.objects.exists(), 30, "both copies sent")
    time.sleep(2)  # the second copy is consumed (and skipped) by now
    assert TaskRun.objects.filter(tag="ledger", task_id="7").count() == 1
    assert len(events.records("ledger", "start")) == 1
    assert "already handled event" in ledger.output()  # the copy came, was skipped
    events.set_failures("ledger", 2)
    fire(order_created, range(8, 9))
    wait_until(
        lambda: len(events.records("ledger", "done")) == 2, 60, "event 8",
        lambda: str(events.records("ledger", "start")),
    )  # fmt: skip
    time.sleep(1)
    starts = [r for r in events.records("ledger", "start") if r["payload"] == 8]
    assert len(starts) == 3
    assert TaskRun.objects.filter(tag="ledger", task_id="8").count() == 1
