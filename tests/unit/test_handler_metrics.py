"""Handler metrics from processor events, with a recording sink and canned backlogs."""

from __future__ import annotations

import pytest

from celery_outbox.handlers.metrics import HandlerMetrics
from celery_outbox.handlers.observations import (
    MessageHandled,
    MessagesCoalesced,
    PassDone,
)
from celery_outbox.outcomes import Action
from celery_outbox.store.handlers import HandlerStats

from .fakes import FakeClock


class RecordingSink:
    """A sink that keeps what it was given: counters summed, last gauges, observations."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.observed: dict[str, list[float]] = {}

    def count(self, name: str, value: float) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def gauge(self, name: str, value: float) -> None:
        self.gauges[name] = value

    def observe(self, name: str, value: float) -> None:
        self.observed.setdefault(name, []).append(value)


def backlog(database: str, **values: object) -> HandlerStats:
    fields: dict[str, object] = {
        "database": database,
        "messages": 0,
        "shards": 0,
        "blocked": 0,
        "paused_shards": 0,
        "paused_categories": (),
        "paused_shard_keys": (),
        "oldest_age": None,
        "lag": None,
        "dead_letters": 0,
    }
    fields.update(values)
    return HandlerStats(**fields)  # type: ignore[arg-type]


def handled(outcome: Action, age: float | None = 2.0) -> MessageHandled:
    return MessageHandled("default", "org:1", "org.update", outcome, 1, 0.25, age)


def test_outcomes_count_and_time_like_the_relays() -> None:
    sink = RecordingSink()
    metrics = HandlerMetrics(sink)
    for outcome in (Action.DELETE, Action.DELETE, Action.RETRY, Action.DEAD_LETTER):
        metrics(handled(outcome))
    metrics(MessagesCoalesced("default", "org:1", {"org.update": 3, "org.delete": 1}))
    metrics(handled(Action.DELETE, age=None))  # no age measured: no lag observation

    assert sink.counters == {
        "handler_processed_total": 3,
        "handler_retried_total": 1,
        "handler_dead_lettered_total": 1,
        "handler_coalesced_total": 4,
    }
    assert sink.observed["handler_run_seconds"] == [0.25] * 5
    # Only messages that ran to success count towards the write-to-done lag.
    assert sink.observed["handler_commit_to_done_seconds"] == [2.0, 2.0]


def test_gauges_sum_counts_and_take_the_oldest_age_over_databases() -> None:
    reports = {
        "pg": backlog("pg", messages=5, waiting=2, blocked=1, oldest_age=40.0, lag=3.0),
        "maria": backlog(
            "maria", messages=7, waiting=1, paused_shards=2, dead_letters=4, lag=9.0
        ),
    }
    sink = RecordingSink()
    HandlerMetrics(sink, ("pg", "maria"), stats=reports.__getitem__).sample()

    assert sink.gauges == {
        "handler_messages": 12,
        "handler_shards_waiting": 3,
        "handler_shards_blocked": 1,
        "handler_shards_paused": 2,
        "handler_dead": 4,
        "handler_oldest_seconds": 40.0,
        "handler_lag_seconds": 9.0,
    }


def test_a_pass_samples_at_most_every_interval_and_a_failed_sample_is_skipped() -> None:
    clock = FakeClock()
    asked: list[str] = []

    def stats(alias: str) -> HandlerStats:
        asked.append(alias)
        if alias == "down":
            raise OSError("connection refused")
        return backlog(alias, messages=1)

    sink = RecordingSink()
    metrics = HandlerMetrics(
        sink, ("down", "up"), sample_every=15.0, clock=clock, stats=stats
    )
    metrics(PassDone(claimed=0))
    clock.advance(10)
    metrics(PassDone(claimed=3))
    assert asked == ["down", "up"]  # once: 10 s is within the interval
    assert sink.gauges["handler_messages"] == 1  # from the database that answered
    clock.advance(6)
    metrics(PassDone(claimed=0))
    assert asked == ["down", "up", "down", "up"]


@pytest.mark.parametrize("outcome", [Action.DELETE, Action.RETRY, Action.DEAD_LETTER])
def test_every_outcome_has_a_counter(outcome: Action) -> None:
    sink = RecordingSink()
    HandlerMetrics(sink)(handled(outcome))
    assert sum(sink.counters.values()) == 1
