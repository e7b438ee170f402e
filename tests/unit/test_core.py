"""The relay's pure decisions: backoff, per-message fate, grouping, the breaker."""

from __future__ import annotations

import pytest

from celery_outbox.outcomes import Action, Decision, Outcome, PublishResult, Settlement
from celery_outbox.relay.core import (
    Breaker,
    RetryPolicy,
    Suspects,
    backoff,
    decide,
    judge_alone,
    settle,
)

POLICY = RetryPolicy(
    max_attempts=3, base_seconds=2.0, max_seconds=10.0, outage_cooldown=7.0
)


def low() -> float:
    return 0.0


def high() -> float:
    return 1.0


@pytest.mark.parametrize(
    ("attempt", "ceiling"),
    [(1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (50, 10.0), (10_000, 10.0)],
)
def test_backoff_is_capped_exponential_with_equal_jitter(
    attempt: int, ceiling: float
) -> None:
    assert backoff(attempt, POLICY, low) == ceiling / 2
    assert backoff(attempt, POLICY, high) == ceiling


def test_published_rows_are_deleted() -> None:
    decision = decide(PublishResult(1, Outcome.PUBLISHED), 0, POLICY, low)
    assert decision == Decision(1, Action.DELETE)


def test_a_failure_is_retried_later_with_its_reason() -> None:
    decision = decide(
        PublishResult(1, Outcome.FAILED, "NotFound: no exchange"), 0, POLICY, high
    )
    assert decision.action is Action.RETRY
    assert decision.delay == 2.0
    assert decision.error == "NotFound: no exchange"


def test_the_last_attempt_goes_to_the_dead_letters() -> None:
    result = PublishResult(1, Outcome.FAILED, "PreconditionFailed: too large")
    assert decide(result, 1, POLICY, low).action is Action.RETRY
    dead = decide(result, 2, POLICY, low)
    assert dead == Decision(1, Action.DEAD_LETTER, 0.0, "PreconditionFailed: too large")


def test_an_outage_releases_the_row_without_using_an_attempt() -> None:
    decision = decide(
        PublishResult(1, Outcome.OUTAGE, "ConnectionRefusedError"), 2, POLICY, low
    )
    assert decision == Decision(1, Action.RELEASE, 7.0, "ConnectionRefusedError")


def test_rows_never_sent_are_released_at_once() -> None:
    assert decide(PublishResult(1, Outcome.NOT_SENT), 0, POLICY, low) == Decision(
        1, Action.RELEASE, 0.0, ""
    )


def test_settlement_groups_decisions_by_action() -> None:
    decisions = [
        Decision(1, Action.DELETE),
        Decision(2, Action.RETRY, 1.0, "x"),
        Decision(3, Action.DELETE),
        Decision(4, Action.DEAD_LETTER, 0.0, "y"),
        Decision(5, Action.RELEASE, 7.0, "z"),
    ]
    settlement = Settlement.of(decisions)
    assert settlement.delete == (1, 3)
    assert [d.message_id for d in settlement.retry] == [2]
    assert [d.message_id for d in settlement.dead_letter] == [4]
    assert [d.message_id for d in settlement.release] == [5]
    assert settlement.size == 5


def test_settlement_decided_from_results_matches_deciding_each_row() -> None:
    results = [
        PublishResult(1, Outcome.PUBLISHED),
        PublishResult(2, Outcome.FAILED, "refused"),
        PublishResult(3, Outcome.PUBLISHED),
        PublishResult(4, Outcome.FAILED, "too large"),
        PublishResult(5, Outcome.OUTAGE, "down"),
        PublishResult(6, Outcome.NOT_SENT),
    ]
    attempts = {1: 0, 2: 0, 3: 5, 4: 2, 5: 2, 6: 0}
    settlement = settle(results, attempts, POLICY, high)
    assert settlement == Settlement(
        delete=(1, 3),
        retry=(Decision(2, Action.RETRY, 2.0, "refused"),),
        dead_letter=(Decision(4, Action.DEAD_LETTER, 0.0, "too large"),),
        release=(
            Decision(5, Action.RELEASE, 7.0, "down"),
            Decision(6, Action.RELEASE, 0.0, ""),
        ),
    )
    assert settlement == Settlement.of(
        decide(r, attempts[r.message_id], POLICY, high) for r in results
    )


def test_an_all_published_batch_is_one_delete() -> None:
    results = [PublishResult(i, Outcome.PUBLISHED) for i in (7, 8, 9)]
    assert settle(results, {}, POLICY, low) == Settlement(delete=(7, 8, 9))


def outage(n: int) -> list[PublishResult]:
    return [PublishResult(i, Outcome.OUTAGE, "down") for i in range(n)]


def test_breaker_opens_after_consecutive_outages_and_closes_on_success() -> None:
    breaker = Breaker(threshold=2, cooldown=30.0)
    breaker = breaker.after_batch(outage(3), now=100.0)
    assert not breaker.is_open(100.0)
    breaker = breaker.after_batch(outage(1), now=101.0)
    assert breaker.is_open(101.0)
    assert breaker.is_open(130.9)
    assert not breaker.is_open(131.0)
    breaker = breaker.after_batch([PublishResult(9, Outcome.PUBLISHED)], now=132.0)
    assert breaker.consecutive_outages == 0
    assert not breaker.is_open(132.0)


def test_a_refused_message_proves_the_broker_is_up() -> None:
    breaker = Breaker(threshold=1, cooldown=30.0).after_batch(
        [PublishResult(1, Outcome.FAILED, "nack")], now=0.0
    )
    assert not breaker.is_open(0.0)
    assert breaker.consecutive_outages == 0


def broke(*ids: int, in_flight: bool = True) -> list[PublishResult]:
    return [
        PublishResult(i, Outcome.OUTAGE, "FrameError: frame_too_large", in_flight)
        for i in ids
    ]


def test_rows_in_flight_when_the_connection_broke_are_sent_alone() -> None:
    suspects = Suspects(threshold=1).after_batch(broke(1, 2, 3))
    assert suspects.alone([1, 2, 3, 4]) == {1, 2, 3}


def test_suspicion_needs_threshold_breaks() -> None:
    once = Suspects(threshold=2).after_batch(broke(1, 2))
    assert once.alone([1, 2]) == frozenset()
    twice = once.after_batch(broke(2))
    assert twice.alone([1, 2]) == {2}


def test_a_broker_condition_never_makes_a_suspect() -> None:
    # Wrong password, resource alarm: publishers do not mark them in flight.
    suspects = Suspects(threshold=1)
    for _ in range(5):
        suspects = suspects.after_batch(broke(1, 2, in_flight=False))
    assert suspects.alone([1, 2]) == frozenset()


def test_a_published_row_is_cleared_and_a_failed_one_stays_alone() -> None:
    suspects = Suspects(threshold=1).after_batch(broke(1, 2))
    after = suspects.after_batch(
        [PublishResult(1, Outcome.PUBLISHED), PublishResult(2, Outcome.FAILED, "x")]
    )
    # A retried poison message must not break a whole batch again.
    assert after.alone([1, 2]) == {2}


def test_suspects_are_bounded() -> None:
    suspects = Suspects(threshold=1, limit=3).after_batch(broke(1, 2, 3, 4, 5))
    assert suspects.alone(range(10)) == {3, 4, 5}


def test_breaking_the_connection_alone_is_the_messages_failure() -> None:
    judged = judge_alone(broke(7)[0])
    assert judged.outcome is Outcome.FAILED
    assert "frame_too_large" in judged.error
    assert "no other message in flight" in judged.error


def test_a_broker_down_while_alone_is_still_an_outage() -> None:
    down = broke(7, in_flight=False)[0]
    assert judge_alone(down) is down
    published = PublishResult(7, Outcome.PUBLISHED)
    assert judge_alone(published) is published
