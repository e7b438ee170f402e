"""The operator's contract: what ``outbox tasks stats``, ``replay``, ``purge`` and the admin
rely on, for every :class:`~celery_outbox.store.OperatorStore`.

A runner subclasses :class:`OperatorContract` and provides a ``harness`` fixture (an
:class:`OperatorHarness`): ``tests/unit/test_memory_store.py`` for the in-memory twin
on a fake clock, ``tests/integration/test_store_contract.py`` for
:class:`~celery_outbox.store.operator.OperatorQueries` on every database alias.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from celery_outbox.envelope import Envelope
from celery_outbox.outcomes import Settlement
from celery_outbox.store import DeadLetterFilter, OperatorStore, Stats

from ..integration.builders import envelope
from .store_contract import (
    LEASE,
    LONG,
    PAST_LEASE,
    StoreHarness,
    dead_letter,
    retry,
    task_ids,
    task_ids_of,
)

#: Long enough for a dead letter to count as old next to one that died after it.
AGE = 0.4


class OperatorHarness(StoreHarness, Protocol):
    """A backend's relay and operator stores, sharing one outbox."""

    operator: OperatorStore

    def now(self) -> datetime:
        """The store's clock as a moment (what ``since`` and ``until`` compare with)."""
        ...

    def dead_ids(self) -> list[int]:
        """The dead letters' own ids, oldest first."""
        ...


def add(
    harness: OperatorHarness, *tags: str, task_name: str = "shop.record", **more: str
) -> list[Envelope]:
    sent = [envelope(tag, task_name=task_name, **more) for tag in tags]
    harness.enqueue(sent)
    return sent


def kill(
    harness: OperatorHarness, *tags: str, task_name: str = "shop.record"
) -> list[Envelope]:
    """Enqueue rows and dead-letter them as a relay would, the broker's reason kept."""
    sent = add(harness, *tags, task_name=task_name)
    claim = harness.store.claim(len(sent), LONG, task_ids=task_ids_of(sent))
    decisions = tuple(dead_letter(m, "PreconditionFailed: big") for m in claim.messages)
    harness.store.settle(claim.token, Settlement(dead_letter=decisions))
    return sent


def refuse(harness: OperatorHarness, sent: Envelope, delay: float = LONG) -> int:
    """Claim one row and settle a refusal: it waits ``delay`` for its retry; its id."""
    claim = harness.store.claim(1, LONG, task_ids=[sent.task_id])
    (message,) = claim.messages
    harness.store.settle(
        claim.token, Settlement(retry=(retry(message, delay, "NotFound: q"),))
    )
    return message.id


def lease(harness: OperatorHarness, sent: Envelope) -> int:
    """Claim one row under a long lease: a relay holds it; its id."""
    (message,) = harness.store.claim(1, LONG, task_ids=[sent.task_id]).messages
    return message.id


def dead_tasks(harness: OperatorHarness) -> list[str]:
    return [letter.task_id for letter in harness.dead_letters()]


class OperatorContract:
    """Tests every operator store must pass; the runner provides ``harness``."""

    def test_stats_and_summary_count_each_state(self, harness: OperatorHarness) -> None:
        assert harness.operator.stats() == Stats(0, 0, 0, 0, None)
        kill(harness, "dead")
        waiting, leased, _ = add(harness, "waiting", "leased", "due")
        add(harness, "other", task_name="shop.add", queue="other")
        refuse(harness, waiting)
        lease(harness, leased)

        stats = harness.operator.stats()
        summary = harness.operator.summary()

        assert (stats.pending, stats.due, stats.in_flight, stats.dead) == (4, 2, 1, 1)
        assert stats.oldest_pending_seconds is not None
        assert stats.oldest_pending_seconds >= 0
        assert (summary.pending, summary.due, summary.retrying) == (4, 2, 1)
        assert (summary.in_flight, summary.dead) == (1, 1)
        assert [(g.task_name, g.queue, g.pending, g.due) for g in summary.backlog] == [
            ("shop.record", "celery", 3, 1),
            ("shop.add", "other", 1, 1),
        ]
        assert [g.task_name for g in harness.operator.summary(groups=1).backlog] == [
            "shop.record"
        ]

    def test_top_failures_rank_task_names_by_refused_rows_and_dead_letters(
        self, harness: OperatorHarness
    ) -> None:
        first, second, _ = add(harness, "a", "b", "fine")
        refuse(harness, first)
        refuse(harness, second)
        kill(harness, "x", "y", task_name="shop.add")
        kill(harness, "z", task_name="shop.flaky")

        top = harness.operator.top_failures(limit=5)

        assert [
            (t.task_name, t.rows, t.attempts, t.max_attempts) for t in top.retrying
        ] == [("shop.record", 2, 2, 1)]
        assert [(t.task_name, t.dead) for t in top.dead] == [
            ("shop.add", 2),
            ("shop.flaky", 1),
        ]
        assert [t.task_name for t in harness.operator.top_failures(limit=1).dead] == [
            "shop.add"
        ]

    def test_retry_now_makes_rows_due_and_leaves_leased_rows_alone(
        self, harness: OperatorHarness
    ) -> None:
        waiting, leased = add(harness, "waiting", "leased")
        waiting_id = refuse(harness, waiting)
        leased_id = lease(harness, leased)

        changed = harness.operator.retry_now([leased_id, waiting_id, 999_999])

        assert changed == [waiting_id]
        again = harness.store.claim(10, LONG).messages
        assert [(m.id, m.attempts) for m in again] == [(waiting_id, 1)]

    def test_moving_to_the_dead_letters_keeps_message_attempts_and_reason(
        self, harness: OperatorHarness
    ) -> None:
        refused, leased, free = add(harness, "refused", "leased", "free")
        refused_id = refuse(harness, refused)
        leased_id = lease(harness, leased)
        free_id = harness.store.claim(1, LEASE, task_ids=[free.task_id]).messages[0].id
        harness.wait(PAST_LEASE)  # the free row's lease ends; the others' hold
        reason = "moved by ada from the admin"

        moved = harness.operator.move_to_dead_letters(
            [free_id, leased_id, refused_id], reason
        )

        assert moved == [refused_id, free_id]
        assert sorted(
            (letter.task_id, letter.attempts, letter.last_error)
            for letter in harness.dead_letters()
        ) == sorted([(refused.task_id, 1, reason), (free.task_id, 0, reason)])
        assert harness.pending() == 1

    def test_a_replay_puts_the_same_message_back_due_now_with_attempts_reset(
        self, harness: OperatorHarness
    ) -> None:
        (poison,) = kill(harness, "poison")
        kill(harness, "other")
        first, _ = harness.dead_ids()

        report = harness.operator.replay_dead_letters(DeadLetterFilter(ids=(first,)))

        assert (report.matched, report.replayed, report.dry_run) == (1, 1, False)
        assert (dict(report.by_task), report.ids) == ({"shop.record": 1}, (first,))
        assert len(harness.dead_letters()) == 1
        (message,) = harness.store.claim(10, LONG).messages
        assert (message.envelope, message.attempts) == (poison, 0)

    def test_a_dry_run_counts_by_task_and_changes_nothing(
        self, harness: OperatorHarness
    ) -> None:
        kill(harness, "a", "b", task_name="billing.charge")
        kill(harness, "c", task_name="shop.add")

        report = harness.operator.replay_dead_letters(DeadLetterFilter(), dry_run=True)

        assert (report.matched, report.replayed, report.dry_run) == (3, 0, True)
        assert dict(report.by_task) == {"billing.charge": 2, "shop.add": 1}
        assert len(harness.dead_letters()) == 3
        assert harness.pending() == 0

    def test_a_replay_selects_by_exact_glob_and_by_time(
        self, harness: OperatorHarness
    ) -> None:
        (early,) = kill(harness, "early", task_name="shop.Export")
        harness.wait(AGE)
        mark = harness.now()
        harness.wait(AGE)
        (late,) = kill(harness, "late", task_name="shop.export")
        nothing = DeadLetterFilter(task="shop.EXPORT")

        assert harness.operator.replay_dead_letters(nothing).matched == 0
        since = harness.operator.replay_dead_letters(
            DeadLetterFilter(task="shop.*", since=mark)
        )
        until = harness.operator.replay_dead_letters(DeadLetterFilter(until=mark))

        assert (since.replayed, until.replayed) == (1, 1)
        replayed = harness.store.claim(10, LONG).messages
        assert task_ids(replayed) == [late.task_id, early.task_id]

    def test_an_empty_id_list_replays_nothing(self, harness: OperatorHarness) -> None:
        kill(harness, "a")
        report = harness.operator.replay_dead_letters(DeadLetterFilter(ids=()))
        assert (report.matched, report.replayed) == (0, 0)
        assert len(harness.dead_letters()) == 1

    def test_a_replay_in_chunks_reports_its_progress(
        self, harness: OperatorHarness
    ) -> None:
        sent = kill(harness, "a", "b", "c", "d", "e")
        seen: list[tuple[int, int]] = []

        report = harness.operator.replay_dead_letters(
            DeadLetterFilter(),
            chunk_size=2,
            progress=lambda done, total: seen.append((done, total)),
        )

        assert seen == [(2, 5), (4, 5), (5, 5)]
        assert len(report.ids) == 5
        assert list(report.ids) == sorted(report.ids)  # oldest dead letter first
        assert sorted(task_ids(harness.store.claim(10, LONG).messages)) == sorted(
            task_ids_of(sent)
        )

    def test_a_purge_deletes_what_is_old_enough_and_matches(
        self, harness: OperatorHarness
    ) -> None:
        kill(harness, "old-a", task_name="shop.add")
        kill(harness, "old-b", task_name="billing.charge")
        harness.wait(2 * AGE)
        (young,) = kill(harness, "young", task_name="shop.add")

        dry = harness.operator.purge_dead_letters(AGE, dry_run=True)
        assert (dry.matched, dry.deleted, dry.dry_run) == (2, 0, True)
        by_task = harness.operator.purge_dead_letters(AGE, task="shop.*", chunk_size=1)
        assert (by_task.matched, by_task.deleted) == (1, 1)
        rest = harness.operator.purge_dead_letters(AGE)
        assert (rest.matched, rest.deleted) == (1, 1)

        assert dead_tasks(harness) == [young.task_id]
        assert harness.operator.purge_dead_letters(AGE).matched == 0

    def test_deleting_dead_letters_reports_the_ids_that_were_there(
        self, harness: OperatorHarness
    ) -> None:
        kill(harness, "a", "b")
        first, second = harness.dead_ids()

        deleted = harness.operator.delete_dead_letters([second, 999_999, second])

        assert deleted == [second]
        assert harness.dead_ids() == [first]
        assert harness.operator.delete_dead_letters([second]) == []
