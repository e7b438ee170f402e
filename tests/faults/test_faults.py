"""Committed ⇒ delivered at least once, while the relay, the broker and the database fail.

Every test drives real processes (relay, Celery worker), real PostgreSQL/MariaDB and a
real RabbitMQ, enqueues a few thousand tasks, injects a fault, and asserts that no
committed task was lost. Duplicates are counted and reported, and bounded where the
design bounds them.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import group
from django.db import connections, transaction
from kombu import Connection, Exchange

from celery_outbox.models import DeadLetter, OutboxMessage
from tests.e2e.conftest import Stack, alias_for, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import record

from ..conftest import BROKER_AMQP

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

E2E = Callable[..., Stack]
FAST_LEASE = ("--lease-seconds", "3", "--send-timeout", "1")


def enqueue(
    prefix: str, count: int, alias: str = "default", per_tx: int = 250
) -> list[str]:
    """Commit ``count`` shop.record tasks, ``per_tx`` per transaction; returns their tags."""
    tags = [f"{prefix}-{i}" for i in range(count)]
    for start in range(0, count, per_tx):
        with transaction.atomic(using=alias):
            group(record.s(tag) for tag in tags[start : start + per_tx]).apply_async()
    return tags


def runs(prefix: str, alias: str = "default") -> Counter[str]:
    """How many times the worker ran each tag."""
    tags = TaskRun.objects.using(alias).filter(tag__startswith=f"{prefix}-")
    return Counter(tags.values_list("tag", flat=True))


def wait_all_ran(
    prefix: str, tags: list[str], timeout: float, alias: str = "default"
) -> None:
    wait_until(
        lambda: len(runs(prefix, alias)) >= len(tags),
        timeout,
        f"all {len(tags)} tasks to run",
        lambda: (
            f"{len(runs(prefix, alias))} ran, {OutboxMessage.objects.using(alias).count()} in the outbox"
        ),
    )


def outbox(alias: str = "default") -> Any:
    return OutboxMessage.objects.using(alias)


def loss_report(
    name: str, tags: list[str], ran: Counter[str], **extra: Any
) -> tuple[int, int]:
    lost = sum(1 for tag in tags if ran[tag] == 0)
    duplicates = sum(count - 1 for count in ran.values() if count > 1)
    figures = " ".join(f"{key}={value}" for key, value in extra.items())
    line = f"{name}: tasks={len(tags)} lost={lost} duplicates={duplicates} {figures}".strip()
    print(line)
    return lost, duplicates


def count_at_broker(queue: str, expected: int, timeout: float = 60.0) -> Counter[str]:
    """Consume the queue and count each task id (the broker's view of what was published)."""
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + timeout
    with Connection(BROKER_AMQP) as conn:
        simple = conn.SimpleQueue(queue)
        try:
            while time.monotonic() < deadline:
                try:
                    message = simple.get(timeout=1.0)
                except simple.Empty:
                    if sum(seen.values()) >= expected:
                        break
                    continue
                seen[message.headers["id"]] += 1
                message.ack()
        finally:
            simple.close()
    return seen


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=120)


@pytest.mark.django_db(transaction=True)
def test_relay_killed_five_times_loses_nothing(e2e: E2E, measured: list[str]) -> None:
    stack = e2e("postgresql")
    stack.start_worker(concurrency=8)
    prefix = f"kill-{uuid.uuid4().hex[:6]}"
    tags = enqueue(prefix, 3000)
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    in_flight_at_kills = 0
    for n in range(5):
        relay = stack.start_relay("--batch-size", "100", *FAST_LEASE, name=f"relay-{n}")
        time.sleep(rng.uniform(0.05, 0.6))
        relay.popen.send_signal(signal.SIGKILL)
        relay.popen.wait(10)
        in_flight_at_kills += outbox().filter(lease_token__isnull=False).count()
    started = time.monotonic()
    stack.start_relay("--batch-size", "100", *FAST_LEASE, name="relay-final")
    wait_all_ran(prefix, tags, 120)
    recovery = time.monotonic() - started
    ran = runs(prefix)
    lost, duplicates = loss_report(
        "kill -9 x5",
        tags,
        ran,
        in_flight_at_kills=in_flight_at_kills,
        recovery_s=f"{recovery:.1f}",
        seed=seed,
    )
    measured.append(
        f"kill -9 relay x5: lost={lost} duplicates={duplicates} (bound {in_flight_at_kills}) recovery={recovery:.1f}s seed={seed}"
    )
    assert lost == 0
    assert duplicates <= in_flight_at_kills
    assert DeadLetter.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_rabbitmq_stopped_mid_drain(e2e: E2E, measured: list[str]) -> None:
    stack = e2e("postgresql")
    # Prefork, as production workers run: the threads pool shares one py-amqp
    # connection between threads and can corrupt frames while it reconnects.
    stack.start_worker(pool="prefork", concurrency=3)
    prefix = f"rmq-{uuid.uuid4().hex[:6]}"
    tags = enqueue(prefix, 3000)
    stack.start_relay("--batch-size", "50", "--broker-outage-cooldown", "1")
    wait_until(lambda: outbox().count() < 2900, 60, "the drain to start")
    rabbitmqctl("stop_app")
    stopped = time.monotonic()
    max_attempts = 0
    try:
        while time.monotonic() - stopped < 4:
            max_attempts = max(
                max_attempts,
                max(outbox().values_list("attempts", flat=True), default=0),
            )
            time.sleep(0.2)
    finally:
        rabbitmqctl("start_app")
    restarted = time.monotonic()
    wait_all_ran(prefix, tags, 180)
    recovery = time.monotonic() - restarted
    lost, duplicates = loss_report(
        "rabbitmq stop", tags, runs(prefix), recovery_s=f"{recovery:.1f}"
    )
    dead = DeadLetter.objects.count()
    measured.append(
        f"RabbitMQ stop_app/start_app: lost={lost} duplicates={duplicates} dead={dead} attempts used={max_attempts} recovery={recovery:.1f}s"
    )
    assert lost == 0
    assert dead == 0
    assert max_attempts == 0, "an outage used up attempts"
    stack.assert_alive()


@pytest.mark.django_db(transaction=True)
def test_relay_database_connection_killed_mid_batch(
    e2e: E2E, measured: list[str]
) -> None:
    stack = e2e("postgresql")
    stack.start_worker(concurrency=8)
    prefix = f"pgkill-{uuid.uuid4().hex[:6]}"
    tags = enqueue(prefix, 3000)
    app_name = f"outbox-relay-{uuid.uuid4().hex[:8]}"
    stack.env["OUTBOX_TEST_APP_NAME"] = app_name
    stack.start_relay("--batch-size", "50", *FAST_LEASE)
    killed = 0
    for _ in range(6):
        time.sleep(0.25)
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                [app_name],
            )
            killed += sum(1 for (ok,) in cursor.fetchall() if ok)
    started = time.monotonic()
    wait_all_ran(prefix, tags, 120)
    recovery = time.monotonic() - started
    lost, duplicates = loss_report(
        "pg_terminate_backend", tags, runs(prefix), killed=killed
    )
    dead = DeadLetter.objects.count()
    measured.append(
        f"relay DB connection killed x{killed}: lost={lost} duplicates={duplicates} dead={dead} recovery={recovery:.1f}s"
    )
    assert killed >= 1, "no relay connection was found to kill"
    assert lost == 0
    assert dead == 0
    stack.assert_alive()  # reconnected, no crash loop


@pytest.mark.parametrize(
    ("vendor", "relays"), [("postgresql", 2), ("postgresql", 4), ("mysql", 2)]
)
@pytest.mark.django_db(databases="__all__", transaction=True)
def test_racing_relays_publish_each_row_once(
    e2e: E2E, measured: list[str], rabbit_queue: str, vendor: str, relays: int
) -> None:
    stack = e2e(vendor)
    alias = alias_for(vendor)
    prefix = f"race-{uuid.uuid4().hex[:6]}"
    tags = enqueue(prefix, 3000, alias=alias)
    expected = {row for row in outbox(alias).values_list("task_id", flat=True)}
    started = time.monotonic()
    for n in range(relays):
        stack.start_relay("--batch-size", "50", name=f"relay-{n}", wait=False)
    wait_until(
        lambda: not outbox(alias).exists(), 120, "the relays to drain the outbox"
    )
    drained = time.monotonic() - started
    seen = count_at_broker(rabbit_queue, len(tags))
    twice = sum(count - 1 for count in seen.values() if count > 1)
    lost = len(expected - set(seen))
    line = f"{relays} relays on {vendor}: tasks={len(tags)} lost={lost} published twice={twice} drain={drained:.1f}s"
    print(line)
    measured.append(line)
    assert lost == 0
    assert twice == 0
    stack.assert_alive()


@pytest.fixture
def small_max_message_size() -> Iterator[int]:
    """RabbitMQ refuses messages over 512 KiB for channels opened meanwhile."""
    limit = 512 * 1024
    rabbitmqctl("eval", f"application:set_env(rabbit, max_message_size, {limit}).")
    yield limit
    rabbitmqctl("eval", "application:set_env(rabbit, max_message_size, 134217728).")


@pytest.mark.django_db(transaction=True)
def test_poison_messages_are_dead_lettered_and_block_nothing(
    e2e: E2E, measured: list[str], small_max_message_size: int
) -> None:
    stack = e2e("postgresql")
    stack.start_worker(concurrency=8)
    prefix = f"poison-{uuid.uuid4().hex[:6]}"
    dead_end = f"outbox-dead-end-{uuid.uuid4().hex[:6]}"
    with Connection(BROKER_AMQP) as conn:
        Exchange(dead_end, "direct", durable=False, auto_delete=False)(
            conn.channel()
        ).declare()
    try:
        good = enqueue(prefix, 1000)
        poison: dict[str, str] = {}
        with transaction.atomic():
            for i in range(4):
                poison[
                    record.apply_async(
                        (f"{prefix}-x{i}",),
                        exchange=f"missing-{uuid.uuid4().hex}",
                        routing_key="x",
                    ).id
                ] = "NotFound"
                poison[
                    record.apply_async(
                        (f"{prefix}-u{i}",), exchange=dead_end, routing_key="nowhere"
                    ).id
                ] = "Unroutable"
                big = "x" * (small_max_message_size + 1024)
                poison[record.apply_async((f"{prefix}-b{i}", big)).id] = (
                    "PreconditionFailed"
                )
        stack.start_relay(
            "--batch-size",
            "200",
            "--max-attempts",
            "2",
            "--retry-base-seconds",
            "0.2",
            "--retry-max-seconds",
            "0.4",
        )
        wait_all_ran(prefix, good, 120)
        wait_until(
            lambda: DeadLetter.objects.count() >= len(poison),
            60,
            "every poison message to be dead-lettered",
        )
    finally:
        with Connection(BROKER_AMQP) as conn:
            conn.channel().exchange_delete(dead_end)
    ran = runs(prefix)
    lost, duplicates = loss_report("poison", good, Counter({t: ran[t] for t in good}))
    reasons = dict(DeadLetter.objects.values_list("task_id", "last_error"))
    measured.append(
        f"poison mix: good={len(good)} lost={lost} duplicates={duplicates} dead letters={len(reasons)}/{len(poison)}"
    )
    assert lost == 0
    assert set(reasons) == set(poison)
    for task_id, kind in poison.items():
        assert kind in reasons[task_id], (
            f"{task_id}: expected {kind!r} in {reasons[task_id]!r}"
        )
    assert not any(
        tag.startswith(f"{prefix}-x") or tag.startswith(f"{prefix}-u") for tag in ran
    )
    assert DeadLetter.objects.get(task_id=next(iter(poison))).attempts == 2


@pytest.mark.django_db(transaction=True)
def test_sigterm_mid_drain_hands_back_leases(
    e2e: E2E, measured: list[str], rabbit_queue: str
) -> None:
    stack = e2e("postgresql")
    prefix = f"term-{uuid.uuid4().hex[:6]}"
    tags = enqueue(prefix, 6000)
    relay = stack.start_relay(
        "--batch-size", "500", "--lease-seconds", "120", "--shutdown-timeout", "10"
    )
    wait_until(lambda: outbox().count() < 6000, 60, "the drain to start")
    relay.send_sigterm()
    sent = time.monotonic()
    code = relay.popen.wait(15)
    stopped_in = time.monotonic() - sent
    still_leased = outbox().filter(lease_token__isnull=False).count()
    left = outbox().count()
    started = time.monotonic()
    code2, log = stack.run_relay("--until-empty", "--lease-seconds", "120", timeout=60)
    finished_in = time.monotonic() - started
    seen = count_at_broker(rabbit_queue, len(tags))
    lost = len(tags) - len(seen)
    line = f"SIGTERM mid-drain: exit={code} in {stopped_in:.2f}s, left={left} leased after exit={still_leased}, successor drained in {finished_in:.1f}s, lost={lost}"
    print(line)
    measured.append(line)
    assert code == 0
    assert stopped_in < 10
    assert still_leased == 0, "rows not started kept their lease"
    assert code2 == 0, log
    assert (
        finished_in < 60
    )  # far below the 120 s lease: nothing waited for a lease to end
    assert lost == 0


@pytest.mark.django_db(transaction=True)
def test_a_killed_relays_batch_is_taken_over_within_ten_seconds(
    e2e: E2E, measured: list[str], rabbit_queue: str
) -> None:
    """kill -9 mid-batch on the default 60 s lease: another relay sends it again at once.

    The dead relay's heartbeat goes stale after 6 s; the next heartbeat of the other
    relay ends its leases and wakes its loop, long before the lease would run out.
    """
    stack = e2e("postgresql")
    prefix = f"takeover-{uuid.uuid4().hex[:6]}"
    tags = enqueue(prefix, 6000, per_tx=1000)
    expected = set(outbox().values_list("task_id", flat=True))
    doomed = stack.start_relay("--batch-size", "6000", name="relay-killed")
    wait_until(
        lambda: outbox().filter(holder__isnull=False).exists(),
        60,
        "the relay to claim its batch",
        interval=0.005,
    )
    doomed.popen.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    doomed.popen.wait(10)
    doomed.long_running = False  # killed on purpose
    in_flight = outbox().filter(lease_token__isnull=False).count()
    successor = stack.start_relay(name="relay-successor")  # the default 60 s lease
    wait_until(lambda: not outbox().exists(), 60, "the successor to drain the outbox")
    recovery = time.monotonic() - killed
    seen = count_at_broker(rabbit_queue, len(tags))
    lost = len(expected - set(seen))
    duplicates = sum(count - 1 for count in seen.values() if count > 1)
    line = (
        f"kill -9 mid-batch, 60 s lease: tasks={len(tags)} in flight={in_flight} "
        f"lost={lost} duplicates={duplicates} recovery={recovery:.1f}s"
    )
    print(line)
    measured.append(line)
    assert in_flight > 0, "the relay finished its batch before the kill"
    assert "took over" in successor.output()
    assert recovery < 10
    assert lost == 0
    assert duplicates <= in_flight
    stack.assert_alive()
