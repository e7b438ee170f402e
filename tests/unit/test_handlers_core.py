"""The pure decisions of the handler processor: coalescing, backoff, dead letters."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from celery_outbox.engine.backoff import backoff
from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.handlers.core import Row, after_failure, coalesce, shard_key
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.outcomes import Action

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def rows(*specs: tuple[str, str]) -> list[Row]:
    return [Row(i, cat, obj, "null", T0) for i, (cat, obj) in enumerate(specs, 1)]


def test_coalescing_keeps_the_newest_row_of_each_key_in_its_place() -> None:
    window = rows(("org", "1"), ("proj", "9"), ("org", "2"), ("org", "1"), ("log", "1"))
    plan = coalesce(window, lambda name: name != "log")
    assert [r.id for r in plan.run] == [2, 3, 4, 5]
    assert plan.superseded == (1,)
    assert plan.coalesced == {"org": 1}


def test_a_category_that_opts_out_keeps_every_row() -> None:
    window = rows(("log", "1"), ("log", "1"), ("log", "1"))
    plan = coalesce(window, lambda name: False)
    assert [r.id for r in plan.run] == [1, 2, 3]
    assert plan.superseded == ()


def test_coalescing_1000_updates_of_10_objects_runs_10() -> None:
    window = [Row(i, "org", str(i % 10), "null", T0) for i in range(1, 1001)]
    plan = coalesce(window, lambda name: True)
    assert [r.id for r in plan.run] == list(range(991, 1001))
    assert len(plan.superseded) == 990


def most() -> float:
    return 1.0


def least() -> float:
    return 0.0


def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    assert [backoff(n, 1.0, 3600.0, most) for n in range(1, 6)] == [1, 2, 4, 8, 16]
    assert backoff(12, 1.0, 3600.0, most) == 2048.0
    assert backoff(13, 1.0, 3600.0, most) == 3600.0
    assert backoff(100_000, 1.0, 3600.0, most) == 3600.0  # no float overflow
    assert backoff(0, 1.0, 3600.0, most) == 0.0


def test_backoff_jitters_between_half_and_the_whole_ceiling() -> None:
    # Processors that failed together do not come back together.
    assert backoff(3, 1.0, 3600.0, least) == 2.0
    assert backoff(3, 1.0, 3600.0, lambda: 0.5) == 3.0
    assert backoff(3, 1.0, 3600.0, most) == 4.0


def test_a_head_retries_forever_unless_its_category_sets_max_attempts() -> None:
    forever = after_failure(7, 50, None, 1.0, 3600.0, most)
    assert (forever.message_id, forever.action, forever.delay) == (
        7,
        Action.RETRY,
        3600.0,
    )
    assert after_failure(7, 2, 3, 1.0, 60.0, most).action is Action.RETRY
    assert after_failure(7, 3, 3, 1.0, 60.0, most).action is Action.DEAD_LETTER


def test_a_newer_message_beyond_the_window_supersedes_its_object() -> None:
    # The shard holds id 50 for org 1, past the rows read: 1 and 4 do not run.
    window = rows(("org", "1"), ("proj", "9"), ("org", "2"), ("org", "1"))
    plan = coalesce(window, lambda name: True, {("org", "1"): 50})
    assert [r.id for r in plan.run] == [2, 3]
    assert plan.superseded == (1, 4)
    assert plan.coalesced == {"org": 2}


def test_shard_keys() -> None:
    assert shard_key(("org", 42)) == "org:42"
    assert shard_key("org:42") == "org:42"
    with pytest.raises(ValueError):
        shard_key(())
    with pytest.raises(ValueError):
        shard_key("")


def test_one_receiver_per_category() -> None:
    registry = Registry()

    def first(**kw: object) -> None: ...

    def second(**kw: object) -> None: ...

    registry.add(Category("org.update", first))
    registry.add(Category("org.update", first))  # re-import of the same module
    with pytest.raises(OutboxConfigurationError, match="already has a receiver"):
        registry.add(Category("org.update", second))
    with pytest.raises(OutboxConfigurationError, match="max_attempts"):
        registry.add(Category("x", first, max_attempts=0))
    with pytest.raises(OutboxConfigurationError, match=r"NUL.*at position 3"):
        registry.add(Category("org\x00update", first))
    with pytest.raises(OutboxConfigurationError, match="at most 255"):
        registry.add(Category("o" * 256, first))
    assert registry.coalesces("org.update") and not registry.coalesces("unknown")
