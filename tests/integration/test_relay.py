"""The relay loop on a real database, with the in-memory publisher as the broker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import transaction
from kombu import Connection, Queue

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.broker.amqp import AmqpPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.engine.loop import Turn
from celery_outbox.envelope import StoredMessage
from celery_outbox.exceptions import OutboxDatabaseError
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import Outcome, PublishResult, Settlement
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import Idle, RelayObservation, StopReason
from celery_outbox.store import Stores
from celery_outbox.store.store import RelayQueries
from celery_outbox.store.types import SettleReport

from ..conftest import BROKER_AMQP
from .builders import envelope, start_in_thread

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

FAST = OutboxSettings(
    max_attempts=3,
    retry_base_seconds=0.01,
    retry_max_seconds=0.02,
    broker_outage_cooldown=60.0,
    poll_interval=0.05,
)


def relay_for(alias: str, publisher: InMemoryPublisher, **overrides: object) -> Relay:
    config = RelayConfig.from_settings(FAST, **overrides)
    return Relay(Stores(alias).relay(), publisher, config, observers=())


def enqueue(alias: str, *tags: str) -> None:
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert([envelope(tag) for tag in tags])


def test_until_empty_publishes_everything_and_returns(alias: str) -> None:
    enqueue(alias, *[f"t{i}" for i in range(30)])
    publisher = InMemoryPublisher()
    assert (
        relay_for(alias, publisher, batch_size=7, until_empty=True).run()
        is StopReason.EMPTY
    )
    assert len(publisher.published) == 30
    assert len({e.task_id for e in publisher.published}) == 30
    assert OutboxMessage.objects.using(alias).count() == 0


def refuse_poison(message: StoredMessage) -> PublishResult | None:
    if message.envelope.task_id.startswith("poison"):
        return PublishResult(
            message.id, Outcome.FAILED, "PreconditionFailed: body too large"
        )
    return None


def test_a_poison_message_is_dead_lettered_after_its_attempts_and_blocks_nothing(
    alias: str,
) -> None:
    enqueue(alias, "good-1", "poison", "good-2")
    publisher = InMemoryPublisher(refuse_poison)
    relay = relay_for(alias, publisher, until_empty=True)
    deadline = time.monotonic() + 10
    while OutboxMessage.objects.using(alias).exists() and time.monotonic() < deadline:
        relay.run()
        time.sleep(0.02)
    assert sorted(e.task_id.split("-")[0] for e in publisher.published) == [
        "good",
        "good",
    ]
    dead = DeadLetter.objects.using(alias).get()
    assert dead.task_id.startswith("poison")
    assert dead.attempts == 3
    assert dead.last_error == "PreconditionFailed: body too large"


@pytest.mark.parametrize("alias", ["default"])
def test_a_header_rabbitmq_cannot_carry_is_dead_lettered_and_stops_nothing(
    alias: str,
) -> None:
    # JSON stores any integer; AMQP tables stop at 64 bits. The relay must neither
    # crash on such a row (it would come back after its lease, forever) nor let it
    # hold up the rows around it.
    queue = f"outbox-relay-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(
            [
                envelope(tag, routing_key=queue, declare=(queue,), queue=queue)
                for tag in ("good-1", "good-2")
            ]
            + [envelope("huge", headers={"id": "huge", "n": 2**70}, declare=())]
        )
    publisher = AmqpPublisher(
        lambda: Connection(BROKER_AMQP, connect_timeout=2),
        lambda name: Queue(name, routing_key=name),
    )
    relay = relay_for(alias, publisher, until_empty=True)
    try:
        deadline = time.monotonic() + 10
        while (
            OutboxMessage.objects.using(alias).exists() and time.monotonic() < deadline
        ):
            relay.run()
            time.sleep(0.02)
        dead = DeadLetter.objects.using(alias).get()
        assert dead.task_id.startswith("huge")
        assert dead.attempts == 3
        assert "cannot be encoded for AMQP" in dead.last_error
        with Connection(BROKER_AMQP) as conn:
            channel = conn.channel()
            assert channel.queue_declare(queue, passive=True)[1] == 2
            channel.queue_delete(queue)
    finally:
        publisher.close()


def test_an_outage_uses_no_attempts_and_opens_the_breaker(alias: str) -> None:
    enqueue(alias, "a", "b")
    publisher = InMemoryPublisher()
    publisher.down = True
    relay = relay_for(alias, publisher, breaker_threshold=1, broker_outage_cooldown=0.3)
    assert relay.run_once() is Turn.PARTIAL
    rows = list(
        OutboxMessage.objects.using(alias).values_list("attempts", "lease_token")
    )
    assert rows == [(0, None), (0, None)]
    assert relay.breaker.is_open(relay.clock())
    assert relay.run_once() is Turn.PAUSED  # claims nothing while open
    publisher.down = False
    time.sleep(0.35)
    assert relay.run_once() is Turn.PARTIAL
    assert len(publisher.published) == 2
    assert DeadLetter.objects.using(alias).count() == 0


def test_a_failing_listener_never_undoes_a_settlement(alias: str) -> None:
    enqueue(alias, "a")
    seen: list[RelayObservation] = []

    def broken(event: RelayObservation) -> None:
        seen.append(event)
        raise RuntimeError("metrics are down")

    relay = Relay(
        Stores(alias).relay(),
        InMemoryPublisher(),
        RelayConfig.from_settings(FAST),
        observers=[broken],
    )
    assert relay.run_once() is Turn.PARTIAL
    assert len(seen) == 1
    assert OutboxMessage.objects.using(alias).count() == 0


@pytest.mark.parametrize("alias", ["default"])
class SettleFailsOnceAndStops(RelayQueries):
    """A store whose first settlement fails as the relay is asked to stop."""

    relay: Relay | None = None
    failed = False

    def settle(self, token: str, settlement: Settlement) -> SettleReport:
        if not self.failed:
            self.failed = True
            assert self.relay is not None
            self.relay.stop()
            raise OutboxDatabaseError("server closed the connection unexpectedly")
        return super().settle(token, settlement)


def test_a_settlement_left_by_a_database_error_is_retried_on_stop(alias: str) -> None:
    # Otherwise the published rows come back after their lease and go out again.
    enqueue(alias, "a", "b", "c")
    publisher = InMemoryPublisher()
    store = SettleFailsOnceAndStops(alias)
    relay = Relay(store, publisher, RelayConfig.from_settings(FAST), observers=())
    store.relay = relay
    assert relay.run() is StopReason.SIGNAL
    assert store.failed
    assert len(publisher.published) == 3
    assert OutboxMessage.objects.using(alias).count() == 0


def test_stop_ends_an_idle_wait_at_once(alias: str) -> None:
    relay = relay_for(alias, InMemoryPublisher(), poll_interval=30.0)
    result: list[StopReason] = []

    thread = start_in_thread(relay, result)
    time.sleep(0.3)
    started = time.monotonic()
    relay.stop()
    thread.join(5)
    assert result == [StopReason.SIGNAL]
    assert time.monotonic() - started < 1.0


def test_stop_mid_batch_hands_back_unsent_rows_at_once(alias: str) -> None:
    enqueue(alias, *[f"s{i}" for i in range(10)])
    relays: list[Relay] = []

    def stop_after_three(message: StoredMessage) -> PublishResult | None:
        if len(publisher.published) == 2:
            relays[0].stop()  # as SIGTERM would, while the batch is being published
        return None

    publisher = InMemoryPublisher(stop_after_three)
    relays.append(relay_for(alias, publisher, batch_size=10))
    relays[0].run_once()
    assert len(publisher.published) == 3
    # The other seven were never started: no lease left on them, due now.
    rows = OutboxMessage.objects.using(alias)
    assert rows.count() == 7
    assert not rows.filter(lease_token__isnull=False).exists()
    successor = InMemoryPublisher()
    assert relay_for(alias, successor, until_empty=True).run() is StopReason.EMPTY
    assert len(successor.published) == 7


def test_a_slow_batch_keeps_its_lease(alias: str) -> None:
    enqueue(alias, "slow-1", "slow-2")
    store = Stores(alias).relay()
    stolen: list[int] = []

    def slow(message: StoredMessage) -> PublishResult | None:
        time.sleep(0.7)  # longer than the lease below: the relay must renew it
        stolen.extend(m.id for m in store.claim(10, 30).messages)
        return None

    relay = relay_for(
        alias, InMemoryPublisher(slow), lease_seconds=1.0, send_timeout=0.5
    )
    relay.run_once()
    assert stolen == []
    assert OutboxMessage.objects.using(alias).count() == 0


@pytest.mark.parametrize("alias", ["default"])
def test_the_liveness_file_is_touched_while_idle(alias: str, tmp_path: Path) -> None:
    path = tmp_path / "alive"
    relay = relay_for(
        alias,
        InMemoryPublisher(),
        poll_interval=30.0,
        liveness_file=str(path),
        liveness_interval=0.2,
    )

    thread = start_in_thread(relay)
    try:
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = path.stat().st_mtime
        time.sleep(1.6)
        assert path.stat().st_mtime > first, (
            "the idle relay stopped touching its liveness file"
        )
    finally:
        relay.stop()
        thread.join(5)


# -- prefetching: the next batch is claimed on a second connection ------------------


def leased(alias: str) -> int:
    return OutboxMessage.objects.using(alias).filter(lease_token__isnull=False).count()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("alias", ["default", "mysql"])
def test_the_next_batch_is_claimed_while_one_is_published(alias: str) -> None:
    enqueue(alias, *[f"p{i}" for i in range(12)])
    seen_leased: list[int] = []

    def watch(message: StoredMessage) -> PublishResult | None:
        if not seen_leased:
            # The first message of the first batch: the second batch gets claimed
            # meanwhile, by the prefetching connection.
            wait_for(lambda: leased(alias) >= 8)
            seen_leased.append(leased(alias))
        return None

    publisher = InMemoryPublisher(watch)
    relay = relay_for(alias, publisher, batch_size=4, until_empty=True)
    assert relay.run() is StopReason.EMPTY
    assert seen_leased == [8]
    task_ids = [e.task_id for e in publisher.published]
    assert len(task_ids) == len(set(task_ids)) == 12
    assert OutboxMessage.objects.using(alias).count() == 0


def test_sqlite_claims_one_batch_at_a_time() -> None:
    enqueue("sqlite", *[f"q{i}" for i in range(12)])
    most: list[int] = []

    def watch(message: StoredMessage) -> PublishResult | None:
        most.append(leased("sqlite"))
        return None

    relay = relay_for(
        "sqlite", InMemoryPublisher(watch), batch_size=4, until_empty=True
    )
    assert relay.run() is StopReason.EMPTY
    assert max(most) == 4


@pytest.mark.parametrize("alias", ["default", "mysql"])
def test_stopping_hands_back_a_prefetched_batch(alias: str) -> None:
    enqueue(alias, *[f"h{i}" for i in range(12)])
    relays: list[Relay] = []

    def stop_once_prefetched(message: StoredMessage) -> PublishResult | None:
        if not publisher.published:
            assert wait_for(lambda: leased(alias) >= 8)
            relays[0].stop()  # as SIGTERM would
        return None

    publisher = InMemoryPublisher(stop_once_prefetched)
    relays.append(relay_for(alias, publisher, batch_size=4))
    assert relays[0].run() is StopReason.SIGNAL
    assert len(publisher.published) == 1
    rows = OutboxMessage.objects.using(alias)
    assert rows.count() == 11
    assert leased(alias) == 0  # the prefetched batch went back, unleased
    assert set(rows.values_list("attempts", flat=True)) == {0}
    successor = InMemoryPublisher()
    assert relay_for(alias, successor, until_empty=True).run() is StopReason.EMPTY
    assert len(successor.published) == 11


@pytest.mark.parametrize("alias", ["default", "mysql"])
def test_an_open_breaker_hands_back_a_prefetched_batch(alias: str) -> None:
    enqueue(alias, *[f"b{i}" for i in range(12)])
    publisher = InMemoryPublisher()
    publisher.down = True
    relay = relay_for(alias, publisher, batch_size=4, breaker_threshold=1)
    pauses: list[RelayObservation] = []
    relay.observers.append(
        lambda event: pauses.append(event) if isinstance(event, Idle) else None
    )
    thread = start_in_thread(relay)
    try:
        # The first batch hit the outage; the breaker opened, and the relay paused.
        assert wait_for(lambda: bool(pauses))
        time.sleep(0.5)  # room for a claim still in flight to land (it must not)
        rows = OutboxMessage.objects.using(alias)
        assert leased(alias) == 0
        # The first batch waits out the cooldown; the batch claimed meanwhile went
        # back at once, due now, with no attempt used; the rest was never claimed.
        assert rows.exclude(last_error="").count() == 4
        assert rows.filter(last_error="").count() == 8
        assert set(rows.values_list("attempts", flat=True)) == {0}
        assert publisher.published == []
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("column", "text"),
    [
        ("declare_queues", "not json"),
        ("declare_queues", "5"),
        ("declare_queues", "[1, 2]"),
        ("headers", "not json"),
        ("headers", '["a", "list"]'),
        ("headers", "{truncated"),
        ("properties", "null"),
        ("properties", '"text"'),
    ],
)
def test_a_row_the_relay_cannot_read_is_dead_lettered_and_blocks_nothing(
    alias: str, column: str, text: str
) -> None:
    # A row edited by hand (or damaged): reading it fails. It must not stop the
    # claim of every batch it is in, nor be published with what it holds.
    enqueue(alias, "good-1", "damaged", "good-2")
    OutboxMessage.objects.using(alias).filter(task_id__startswith="damaged").update(
        **{column: text}
    )
    publisher = InMemoryPublisher()
    assert relay_for(alias, publisher, until_empty=True).run() is StopReason.EMPTY
    assert sorted(e.task_id.split("-")[0] for e in publisher.published) == [
        "good",
        "good",
    ]
    assert not OutboxMessage.objects.using(alias).exists()
    dead = DeadLetter.objects.using(alias).get()
    assert dead.task_id.startswith("damaged")
    assert getattr(dead, column) == text  # kept as it was, to be fixed and replayed
    assert "cannot be read" in dead.last_error
    assert column in dead.last_error
