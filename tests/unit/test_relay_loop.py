"""The real relay loop with no database and no broker: InMemoryStore, InMemoryPublisher.

Time is a fake clock that the relay's waiter moves on instead of sleeping, and that
the tests move past leases, backoffs and cooldowns.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.cli.exits import ExitStatus, exit_status
from celery_outbox.engine.loop import Turn
from celery_outbox.engine.observations import OBSERVER_FAILURES
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Outcome, PublishResult, Settlement
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.core import RetryPolicy
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import (
    BatchSettled,
    BreakerOpened,
    RelayObservation,
    StopReason,
)
from celery_outbox.store.memory import InMemoryStore

from ..integration.builders import envelope
from .fakes import FakeClock, FakeWaiter

POLICY = RetryPolicy(
    max_attempts=3, base_seconds=1.0, max_seconds=4.0, outage_cooldown=20.0
)
REFUSED = "PreconditionFailed: body too large"


class World:
    """A relay wired to in-memory parts, and what it told its observers."""

    def __init__(self, publisher: InMemoryPublisher | None = None, **config: Any):
        self.clock = FakeClock()
        self.store = InMemoryStore(self.clock)
        self.publisher = publisher or InMemoryPublisher()
        self.events: list[RelayObservation] = []
        values: dict[str, Any] = {
            "batch_size": 10,
            "lease_seconds": 30.0,
            "poll_interval": 1.0,
            "send_timeout": 10.0,
            "policy": POLICY,
            "breaker_threshold": 2,
            **config,
        }
        relay_config = RelayConfig(**values)
        relay_config.validate()
        self.relay = Relay(
            self.store,
            self.publisher,
            relay_config,
            clock=self.clock,
            random_source=lambda: 0.5,  # backoffs exactly 3/4 of their ceiling
            waiter=FakeWaiter(self.clock),
            observers=[self.events.append],
        )

    def enqueue(self, *tags: str) -> list[str]:
        envelopes = [envelope(tag) for tag in tags]
        self.store.add(envelopes)
        return [e.task_id for e in envelopes]

    def published(self) -> list[str]:
        return [e.task_id for e in self.publisher.published]


def refuse(prefix: str) -> Any:
    """A broker that refuses every message whose task id starts with ``prefix``."""

    def behaviour(message: StoredMessage) -> PublishResult | None:
        if message.envelope.task_id.startswith(prefix):
            return PublishResult(message.id, Outcome.FAILED, REFUSED)
        return None

    return behaviour


def test_everything_is_published_in_order_and_deleted() -> None:
    world = World(until_empty=True)
    sent = world.enqueue(*[f"t{n}" for n in range(25)])
    assert world.relay.run() is StopReason.EMPTY
    assert world.published() == sent
    assert world.store.pending() == 0
    assert world.store.dead == ()
    batches = [e for e in world.events if isinstance(e, BatchSettled)]
    assert [(b.claimed, b.report.deleted) for b in batches] == [
        (10, 10),
        (10, 10),
        (5, 5),
    ]


def test_a_refused_message_is_retried_with_backoff_then_dead_lettered() -> None:
    world = World(InMemoryPublisher(refuse("poison")))
    good = world.enqueue("good-1")
    poison = world.enqueue("poison")
    good += world.enqueue("good-2")

    assert world.relay.run_once() is Turn.PARTIAL
    assert world.published() == good  # the refusal held nothing up
    (row,) = world.store.rows
    # Retry 1 of base 1 s: a ceiling of 1 s, of which the jitter of 0.5 takes 3/4.
    assert (row.attempts, row.last_error) == (1, REFUSED)
    assert row.available_at == world.clock() + 0.75

    world.clock.advance(0.5)
    assert world.relay.run_once() is Turn.EMPTY  # not due yet
    world.clock.advance(0.25)
    assert world.relay.run_once() is Turn.PARTIAL
    (row,) = world.store.rows
    assert row.attempts == 2
    assert row.available_at == world.clock() + 1.5  # the ceiling doubled

    world.clock.advance(1.5)
    assert world.relay.run_once() is Turn.PARTIAL
    assert world.store.pending() == 0
    (dead,) = world.store.dead
    assert (dead.envelope.task_id, dead.attempts, dead.last_error) == (
        poison[0],
        3,
        REFUSED,
    )
    assert world.published() == good


def test_an_outage_releases_rows_without_an_attempt_and_opens_the_breaker() -> None:
    world = World()
    sent = world.enqueue("a", "b")
    world.publisher.down = True

    assert world.relay.run_once() is Turn.PARTIAL
    assert [(r.attempts, r.available_at) for r in world.store.rows] == [
        (0, world.clock() + POLICY.outage_cooldown)
    ] * 2
    assert "down" in world.store.rows[0].last_error
    assert not any(isinstance(e, BreakerOpened) for e in world.events)

    world.clock.advance(POLICY.outage_cooldown)
    assert world.relay.run_once() is Turn.PARTIAL  # the second outage in a row
    assert [r.attempts for r in world.store.rows] == [0, 0]
    [opened] = [e for e in world.events if isinstance(e, BreakerOpened)]
    assert opened.seconds == POLICY.outage_cooldown
    assert opened.error == world.store.rows[0].last_error  # the broker's reason

    world.publisher.down = False
    world.clock.advance(POLICY.outage_cooldown - 1)
    assert world.relay.run_once() is Turn.PAUSED  # open: nothing is claimed
    world.clock.advance(1)
    assert world.relay.run_once() is Turn.PARTIAL
    assert world.published() == sent
    assert world.store.pending() == 0
    assert world.store.dead == ()


def test_rows_of_a_crashed_relay_are_claimed_again_once_its_lease_ends() -> None:
    world = World()
    sent = world.enqueue("a", "b")
    crashed = world.store.claim(10, 30.0)  # and never settles

    assert world.relay.run_once() is Turn.EMPTY
    assert world.published() == []
    world.clock.advance(30.0)
    assert world.relay.run_once() is Turn.PARTIAL
    assert world.published() == sent
    assert world.store.pending() == 0
    # Whatever the crashed relay writes if it ever comes back is fenced off.
    ids = tuple(m.id for m in crashed.messages)
    assert world.store.settle(crashed.token, Settlement(delete=ids)).deleted == 0


def test_a_stop_mid_batch_hands_the_unsent_rows_back_without_an_attempt() -> None:
    world = World()

    def stop_after_first(message: StoredMessage) -> PublishResult | None:
        world.relay.stop()
        return None

    world.publisher.behaviour = stop_after_first
    sent = world.enqueue("a", "b", "c")
    assert world.relay.run() is StopReason.SIGNAL
    assert world.published() == sent[:1]
    assert [(r.attempts, r.available_at, r.lease_token) for r in world.store.rows] == [
        (0, world.clock(), None)
    ] * 2


def test_prefetching_on_a_second_thread_publishes_each_row_once_in_order() -> None:
    world = World(batch_size=5, prefetch=True, until_empty=True)
    sent = world.enqueue(*[f"t{n}" for n in range(23)])
    assert world.relay.run() is StopReason.EMPTY
    assert world.published() == sent
    assert world.store.pending() == 0


# -- until empty: a run that could not publish says so (#37) ---------------------


@pytest.mark.parametrize("rows", [3, 45])  # less than a batch; past the breaker
def test_until_empty_with_the_broker_down_ends_unfinished_naming_why(
    rows: int,
) -> None:
    world = World(until_empty=True)
    world.publisher.down = True
    world.enqueue(*[f"t{n}" for n in range(rows)])
    assert world.relay.run() is StopReason.UNFINISHED
    left = world.relay.loop.left.unfinished
    assert left is not None
    assert f"{rows} not published, no attempt used (deferred by a broker outage" in left
    assert "ConnectionRefusedError: down" in left
    assert world.store.pending() == rows
    assert {r.attempts for r in world.store.rows} == {0}
    assert exit_status(StopReason.UNFINISHED) != 0


def test_until_empty_ends_unfinished_while_a_refused_row_waits_for_its_retry() -> None:
    world = World(InMemoryPublisher(refuse("poison")), until_empty=True)
    good = world.enqueue("good")
    world.enqueue("poison")
    assert world.relay.run() is StopReason.UNFINISHED
    assert world.published() == good
    left = world.relay.loop.left.unfinished
    assert left is not None
    assert left.startswith("1 row(s) wait in the outbox unsent")
    assert f"refused by the broker, waiting for their retry: {REFUSED}" in left
    # Once it is dead-lettered nothing waits unsent: the run is done.
    world.clock.advance(60)
    world.relay.run()
    world.clock.advance(60)
    assert world.relay.run() is StopReason.EMPTY
    assert len(world.store.dead) == 1


def test_rows_an_outage_deferred_and_a_later_batch_published_leave_nothing_unfinished() -> (
    None
):
    world = World(until_empty=True)
    sent = world.enqueue("a", "b")
    world.publisher.down = True
    assert world.relay.run() is StopReason.UNFINISHED
    world.publisher.down = False
    world.clock.advance(POLICY.outage_cooldown)
    assert world.relay.run() is StopReason.EMPTY
    assert world.published() == sent


def test_every_stop_reason_has_one_exit_status_and_only_unfinished_fails() -> None:
    assert {reason: exit_status(reason) for reason in StopReason} == {
        StopReason.SIGNAL: ExitStatus.OK,
        StopReason.EMPTY: ExitStatus.OK,
        StopReason.UNFINISHED: ExitStatus.FAILED,
        StopReason.HELD: ExitStatus.HELD,
    }


def test_rows_an_earlier_run_deferred_leave_the_next_run_unfinished() -> None:
    # The second run finds nothing due (the cooldown is not over) and claims
    # nothing: what it leaves is read from the outbox, not from its own turns.
    world = World(until_empty=True)
    world.publisher.down = True
    world.enqueue("a", "b")
    assert world.relay.run() is StopReason.UNFINISHED
    again = Relay(
        world.store,
        InMemoryPublisher(),
        world.relay.config,
        clock=world.clock,
        waiter=FakeWaiter(world.clock),
    )
    assert again.run() is StopReason.UNFINISHED
    left = again.loop.left.unfinished
    assert left is not None
    assert "2 not published, no attempt used" in left
    assert "ConnectionRefusedError: down" in left


class BrokenTracing:
    """A tracing hook whose library changed under it: it raises on every batch."""

    def batch(self, messages: Any) -> Any:
        raise AttributeError("module 'sentry_sdk' has no attribute 'start_transaction'")

    def __call__(self, event: object) -> None:
        raise AttributeError("'Span' object has no attribute 'set_tag'")


def test_a_hook_that_fails_every_batch_is_logged_once_then_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    hook = BrokenTracing()
    world.relay.batch_hooks = [hook]
    world.relay.observers.append(hook)
    before = dict(OBSERVER_FAILURES.counts)
    for batch in range(25):
        world.enqueue(f"batch-{batch}")
        world.relay.run_once()
    # Nothing was lost to the hook: every batch was published.
    assert len(world.published()) == 25
    counted = {
        kind: count - before.get(kind, 0)
        for kind, count in OBSERVER_FAILURES.counts.items()
        if kind[0] == "BrokenTracing"
    }
    # The hook fails once per batch; as an observer, once per observation.
    assert counted[("BrokenTracing", "AttributeError")] >= 50
    lines = [r for r in caplog.records if "BrokenTracing" in r.getMessage()]
    with_traceback = [r for r in lines if r.exc_info]
    assert len(with_traceback) == 1
    assert "counted, not logged" in with_traceback[0].getMessage()
    # The count is told at 10 and 100 (and so on), never once per batch.
    assert 1 <= len(lines) - 1 <= 2
    assert all("has failed" in r.getMessage() for r in lines if not r.exc_info)
