"""The relay's, the enqueue's and the operator's contracts against the in-memory
twins, on a fake clock: no database, no sleeping."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import datetime, timezone

import pytest

from celery_outbox.envelope import Envelope
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store.memory import InMemoryStore
from celery_outbox.store.memory_operator import InMemoryOperatorQueries
from celery_outbox.text import ERROR_LIMIT, REPLACEMENT, storable

from ..contract.operator_contract import OperatorContract
from ..contract.store_contract import DeadView, EnqueueContract, StoreContract
from ..integration.builders import envelope
from .fakes import FakeClock


class MemoryHarness:
    """An InMemoryStore and the operator's twin on its tables; time moves only when a
    test waits."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = InMemoryStore(self.clock)
        self.writer = self.store
        self.operator = InMemoryOperatorQueries(self.store.tables)

    def transaction(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), timezone.utc)

    def dead_ids(self) -> list[int]:
        return [d.id for d in self.store.dead]

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        self.store.add(envelopes)

    def wait(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def pending(self) -> int:
        return self.store.pending()

    def state(self, row_id: int) -> tuple[int, str]:
        (row,) = [r for r in self.store.rows if r.id == row_id]
        return row.attempts, row.last_error

    def dead_letters(self) -> list[DeadView]:
        return [
            DeadView(
                d.original_id,
                d.envelope.task_id,
                d.envelope.body,
                d.attempts,
                d.last_error,
            )
            for d in self.store.dead
        ]


@pytest.fixture
def harness() -> MemoryHarness:
    return MemoryHarness()


class TestInMemoryStore(StoreContract):
    """Everything the relay relies on, kept in memory."""


class TestInMemoryStoreWrites(EnqueueContract):
    """What the enqueue path's writer promises, kept in memory."""


class TestInMemoryOperatorQueries(OperatorContract):
    """What operators rely on, on the tables the in-memory relay store keeps."""


def test_ids_increase_and_rows_start_due_with_no_attempt() -> None:
    clock = FakeClock()
    store = InMemoryStore(clock)
    assert store.add([envelope("a")]) + store.add([envelope("b"), envelope("c")]) == [
        1,
        2,
        3,
    ]
    assert [(r.attempts, r.available_at, r.lease_token) for r in store.rows] == [
        (0, clock(), None)
    ] * 3


def test_a_lease_ends_exactly_after_its_seconds() -> None:
    clock = FakeClock()
    store = InMemoryStore(clock)
    store.add([envelope("a")])
    store.claim(10, 5.0)
    clock.advance(4.5)
    assert store.claim(10, 5.0).messages == ()
    clock.advance(0.5)
    assert len(store.claim(10, 5.0).messages) == 1


def test_a_reason_no_database_stores_is_kept_as_a_database_would_keep_it() -> None:
    store = InMemoryStore(FakeClock())
    store.add([envelope("a"), envelope("b")])
    claim = store.claim(10, 5.0)
    first, second = claim.messages
    reason = "refused\x00 \udc80 " + "x" * 5000
    report = store.settle(
        claim.token,
        Settlement(
            retry=(Decision(first.id, Action.RETRY, 1.0, reason),),
            dead_letter=(Decision(second.id, Action.DEAD_LETTER, 0.0, reason),),
        ),
    )
    assert (report.retried, report.dead_lettered) == (1, 1)
    kept = [row.last_error for row in store.rows] + [d.last_error for d in store.dead]
    assert kept == [storable(reason)] * 2
    assert kept[0].startswith(f"refused{REPLACEMENT} {REPLACEMENT} xxx")
    assert len(kept[0]) == ERROR_LIMIT
