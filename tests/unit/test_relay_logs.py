"""Retries and dead letters in the relay's log: one line each, then a summary.

The limiter is pure bookkeeping over a fake clock; the listener is driven by the real
relay loop on in-memory parts, the broker refusing what the test says.
"""

from __future__ import annotations

import logging

import pytest

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Action, Decision, Outcome, PublishResult, Settlement
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.core import RetryPolicy
from celery_outbox.relay.logs import FailureLog, LogLimiter, Suppressed
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import BatchSettled, Idle, log_observation
from celery_outbox.store import SettleReport
from celery_outbox.store.memory import InMemoryStore

from ..integration.builders import envelope
from .fakes import FakeClock, FakeWaiter

REASON = "NotFound: no exchange 'billing' in vhost '/'"


# -- the limiter -------------------------------------------------------------------


def test_the_limiter_lets_the_first_lines_through_and_counts_the_rest() -> None:
    clock = FakeClock()
    limiter = LogLimiter(3, 10.0, clock=clock)
    assert [limiter.allow("retries") for _ in range(5)] == [True] * 3 + [False] * 2
    assert limiter.ended() == []  # the window is still open
    clock.advance(10.0)
    assert limiter.ended() == [Suppressed("retries", 2, 10.0)]
    assert limiter.ended() == []  # told once


def test_each_kind_has_a_window_of_its_own() -> None:
    clock = FakeClock()
    limiter = LogLimiter(1, 10.0, clock=clock)
    assert limiter.allow("retries")
    assert not limiter.allow("retries")
    assert limiter.allow("dead letters")  # a flood of retries hides no dead letter
    clock.advance(4.0)
    assert not limiter.allow("dead letters")
    clock.advance(6.0)  # the retries' window ends; the dead letters' too (opened at 0)
    assert sorted(limiter.ended(), key=lambda s: s.kind) == [
        Suppressed("dead letters", 1, 10.0),
        Suppressed("retries", 1, 10.0),
    ]


def test_a_window_without_lines_held_back_needs_no_summary() -> None:
    clock = FakeClock()
    limiter = LogLimiter(5, 10.0, clock=clock)
    assert all(limiter.allow("retries") for _ in range(5))
    clock.advance(30.0)
    assert limiter.ended() == []
    assert limiter.allow("retries")  # a new window


def test_a_line_after_the_window_opens_a_new_one_and_keeps_the_old_count() -> None:
    clock = FakeClock()
    limiter = LogLimiter(1, 10.0, clock=clock)
    limiter.allow("retries")
    limiter.allow("retries")
    clock.advance(12.0)
    assert limiter.allow("retries")  # the new window's first line
    assert limiter.ended() == [Suppressed("retries", 1, 10.0)]


def test_the_summary_reads_like_a_sentence() -> None:
    assert (
        Suppressed("retries", 4213, 10.0).line()
        == "... and 4,213 more retries in the last 10 s"
    )


@pytest.mark.parametrize(("limit", "interval"), [(0, 10.0), (5, 0.0)])
def test_a_limit_that_would_hide_everything_is_refused(
    limit: int, interval: float
) -> None:
    with pytest.raises(ValueError, match="limit >= 1 and interval > 0"):
        LogLimiter(limit, interval)


# -- the listener, driven by the relay loop ------------------------------------------


class Refusing:
    """A relay on in-memory parts whose broker refuses every message."""

    def __init__(self, *, limit: int, max_attempts: int = 3) -> None:
        self.clock = FakeClock()
        self.store = InMemoryStore(self.clock)
        config = RelayConfig(
            batch_size=100,
            lease_seconds=30.0,
            poll_interval=1.0,
            send_timeout=10.0,
            policy=RetryPolicy(max_attempts, 1.0, 1.0, 20.0),
        )
        self.log = FailureLog(LogLimiter(limit, 10.0, clock=self.clock))
        self.relay = Relay(
            self.store,
            InMemoryPublisher(self.refuse),
            config,
            clock=self.clock,
            random_source=lambda: 1.0,  # every backoff exactly 1 s
            waiter=FakeWaiter(self.clock),
            observers=[self.log],
        )

    @staticmethod
    def refuse(message: StoredMessage) -> PublishResult:
        return PublishResult(message.id, Outcome.FAILED, REASON)

    def enqueue(self, count: int) -> list[str]:
        envelopes = [envelope(f"m{n}") for n in range(count)]
        self.store.add(envelopes)
        return [e.task_id for e in envelopes]


def relay_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "celery_outbox.relay"]


def test_each_retry_is_a_warning_naming_the_task_and_the_brokers_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = Refusing(limit=10)
    [task_id] = world.enqueue(1)
    with caplog.at_level(logging.INFO, logger="celery_outbox.relay"):
        world.relay.run_once()
    [line] = [r for r in relay_lines(caplog) if "refused" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"task shop.record [{task_id}] refused by the broker (attempt 1), retrying "
        f"in 1.0 s: {REASON}"
    )


def test_each_dead_letter_is_logged_with_the_brokers_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = Refusing(limit=10, max_attempts=1)
    [task_id] = world.enqueue(1)
    with caplog.at_level(logging.INFO, logger="celery_outbox.relay"):
        world.relay.run_once()
    [line] = [r for r in relay_lines(caplog) if "dead-lettered" in r.getMessage()]
    assert line.levelno >= logging.WARNING
    assert line.getMessage() == (
        f"task shop.record [{task_id}] dead-lettered after 1 attempts: {REASON}"
    )


def test_a_storm_of_retries_writes_the_limit_then_one_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = Refusing(limit=3, max_attempts=100)
    world.enqueue(50)
    with caplog.at_level(logging.WARNING, logger="celery_outbox.relay"):
        world.relay.run_once()  # 50 refused: 3 lines, 47 counted
        world.clock.advance(10.0)
        world.log(Idle(1.0))  # an idle loop still writes what is due
    messages = [r.getMessage() for r in relay_lines(caplog)]
    assert sum("refused by the broker" in m for m in messages) == 3
    assert messages[-1] == "... and 47 more retries in the last 10 s"
    assert len(messages) == 4


def test_the_next_window_writes_lines_again(caplog: pytest.LogCaptureFixture) -> None:
    world = Refusing(limit=2, max_attempts=100)
    world.enqueue(5)
    with caplog.at_level(logging.WARNING, logger="celery_outbox.relay"):
        world.relay.run_once()
        world.clock.advance(10.0)  # the window ends and every retry is due again
        world.relay.run_once()
    messages = [r.getMessage() for r in relay_lines(caplog)]
    assert messages == [
        *messages[:2],
        "... and 3 more retries in the last 10 s",
        *messages[3:5],
    ]
    assert all("attempt 1)" in m for m in messages[:2])
    assert all("attempt 2)" in m for m in messages[3:5])
    assert len(messages) == 5  # the second window's 3 still wait for their summary


def test_the_breaker_line_says_why_the_broker_is_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store = InMemoryStore(clock)
    publisher = InMemoryPublisher()
    publisher.down = True
    relay = Relay(
        store,
        publisher,
        RelayConfig(
            batch_size=10,
            lease_seconds=30.0,
            poll_interval=1.0,
            send_timeout=10.0,
            policy=RetryPolicy(3, 1.0, 1.0, 20.0),
            breaker_threshold=1,
        ),
        clock=clock,
        waiter=FakeWaiter(clock),
        observers=[log_observation],
    )
    store.add([envelope("a")])
    with caplog.at_level(logging.WARNING, logger="celery_outbox.relay"):
        relay.run_once()
    assert [r.getMessage() for r in relay_lines(caplog)] == [
        "broker unreachable: pausing for 20.0 s: ConnectionRefusedError: down"
    ]


def test_a_head_that_blocks_its_ordering_key_says_which_key_and_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    head = StoredMessage(7, 4, envelope("head", ordering_key="order-42"))
    settled = BatchSettled(
        (head,),
        (PublishResult(7, Outcome.FAILED, REASON),),
        Settlement(block=(Decision(7, Action.BLOCK, 0.0, REASON),)),
        SettleReport(blocked=1),
        0.01,
        0.01,
    )
    with caplog.at_level(logging.WARNING, logger="celery_outbox.relay"):
        FailureLog()(settled)
    [line] = relay_lines(caplog)
    assert line.levelno == logging.ERROR
    assert line.getMessage() == (
        f"task shop.record [{head.envelope.task_id}] failed for good after 5 attempts "
        f"and blocks ordering key 'order-42' (manage.py outbox ordering retry --key KEY, "
        f"or skip --key KEY): {REASON}"
    )
