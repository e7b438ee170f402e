"""The relay's and the enqueue's contracts, for every store backend.

:class:`StoreContract` holds what the relay relies on
(:class:`~celery_outbox.store.RelayStore`), :class:`EnqueueContract` what the
enqueue path's writer promises (:class:`~celery_outbox.store.EnqueueStore`). A
runner subclasses one in a ``Test*`` class and provides a ``harness`` fixture:
``tests/unit/test_memory_store.py`` for :class:`InMemoryStore` on a fake clock,
``tests/integration/test_store_contract.py`` for the Django stores on every
database alias, where time really passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from celery_outbox.envelope import Envelope, StoredMessage
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store.protocol import EnqueueStore, RelayStore
from celery_outbox.store.types import SettleReport

from ..integration.builders import envelope

#: A lease short enough to outlive in a test on a real database.
LEASE = 0.3
#: Comfortably longer than :data:`LEASE`, for clocks that tick in milliseconds.
PAST_LEASE = 0.5
#: Long enough that no test outlives it.
LONG = 30.0


@dataclass(frozen=True)
class DeadView:
    """What a dead letter must keep, whatever the backend."""

    original_id: int
    task_id: str
    body: bytes
    attempts: int
    last_error: str


class StoreHarness(Protocol):
    """One backend under test: its store, and how to enqueue, wait and look inside."""

    store: RelayStore

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        """Write messages as a committed enqueue would."""
        ...

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock (sleep, or move a fake clock)."""
        ...

    def pending(self) -> int:
        """How many rows are in the outbox."""
        ...

    def state(self, row_id: int) -> tuple[int, str]:
        """A row's attempts and last error."""
        ...

    def dead_letters(self) -> list[DeadView]:
        """Every dead letter, oldest first."""
        ...


def task_ids(messages: Sequence[StoredMessage]) -> list[str]:
    return [m.envelope.task_id for m in messages]


def task_ids_of(envelopes: Sequence[Envelope]) -> list[str]:
    return [e.task_id for e in envelopes]


def enqueued(harness: StoreHarness, *tags: str) -> list[Envelope]:
    envelopes = [envelope(tag) for tag in tags]
    harness.enqueue(envelopes)
    return envelopes


def retry(message: StoredMessage, delay: float, error: str) -> Decision:
    return Decision(message.id, Action.RETRY, delay, error)


def release(message: StoredMessage, delay: float = 0.0, error: str = "") -> Decision:
    return Decision(message.id, Action.RELEASE, delay, error)


def dead_letter(message: StoredMessage, error: str) -> Decision:
    return Decision(message.id, Action.DEAD_LETTER, 0.0, error)


class StoreContract:
    """Tests every store backend must pass; the runner provides ``harness``."""

    def test_claim_takes_due_rows_oldest_first_up_to_the_limit(
        self, harness: StoreHarness
    ) -> None:
        sent = enqueued(harness, "a", "b", "c")
        first = harness.store.claim(2, LONG)
        assert [m.envelope for m in first.messages] == sent[:2]
        assert [m.attempts for m in first.messages] == [0, 0]
        rest = harness.store.claim(10, LONG)
        assert task_ids(rest.messages) == [sent[2].task_id]
        assert rest.token != first.token
        assert harness.store.claim(10, LONG).messages == ()

    def test_a_row_due_again_waits_behind_rows_due_before_it(
        self, harness: StoreHarness
    ) -> None:
        a, b = enqueued(harness, "a", "b")
        claim = harness.store.claim(1, LONG)
        assert task_ids(claim.messages) == [a.task_id]
        harness.wait(0.01)
        harness.store.settle(
            claim.token, Settlement(release=(release(claim.messages[0]),))
        )
        assert task_ids(harness.store.claim(1, LONG).messages) == [b.task_id]
        assert task_ids(harness.store.claim(1, LONG).messages) == [a.task_id]

    def test_a_claim_reports_how_long_each_row_has_waited(
        self, harness: StoreHarness
    ) -> None:
        enqueued(harness, "a")
        harness.wait(PAST_LEASE)
        (message,) = harness.store.claim(10, LONG).messages
        assert message.age_seconds is not None
        assert PAST_LEASE - 0.05 <= message.age_seconds < LONG

    def test_a_scheduled_row_waits_for_its_eta_and_says_when_it_is_due(
        self, harness: StoreHarness
    ) -> None:
        later, now = envelope("later", due_in=PAST_LEASE), envelope("now")
        harness.enqueue([later, now])
        assert task_ids(harness.store.claim(10, LONG).messages) == [now.task_id]
        due = harness.store.seconds_until_due()
        assert due is not None and 0 < due <= PAST_LEASE
        assert harness.store.claim(10, LONG).messages == ()
        harness.wait(due + 0.05)
        (message,) = harness.store.claim(10, LONG).messages
        assert message.envelope.task_id == later.task_id
        # Its age counts from its ETA: it was not late while it waited.
        assert message.age_seconds is not None and message.age_seconds < PAST_LEASE

    def test_nothing_waiting_means_no_due_time(self, harness: StoreHarness) -> None:
        assert harness.store.seconds_until_due() is None
        enqueued(harness, "a")
        assert harness.store.seconds_until_due() is None  # due already

    def test_a_lease_keeps_other_claims_away_until_it_ends(
        self, harness: StoreHarness
    ) -> None:
        sent = enqueued(harness, "a", "b")
        first = harness.store.claim(10, LEASE)
        assert task_ids(first.messages) == task_ids_of(sent)
        assert harness.store.claim(10, LONG).messages == ()
        harness.wait(PAST_LEASE)
        second = harness.store.claim(10, LONG)
        assert task_ids(second.messages) == task_ids_of(sent)
        ids = tuple(m.id for m in second.messages)
        assert harness.store.settle(first.token, Settlement(delete=ids)).deleted == 0
        assert harness.pending() == 2
        assert harness.store.settle(second.token, Settlement(delete=ids)).deleted == 2
        assert harness.pending() == 0

    def test_retry_counts_an_attempt_and_waits_out_its_delay(
        self, harness: StoreHarness
    ) -> None:
        enqueued(harness, "a")
        claim = harness.store.claim(10, LONG)
        (row,) = claim.messages
        settlement = Settlement(retry=(retry(row, LEASE, "NotFound: boom"),))
        assert harness.store.settle(claim.token, settlement) == SettleReport(retried=1)
        assert harness.state(row.id) == (1, "NotFound: boom")
        assert harness.store.claim(10, LONG).messages == ()
        harness.wait(PAST_LEASE)
        again = harness.store.claim(10, LONG).messages
        assert [(m.id, m.attempts) for m in again] == [(row.id, 1)]

    def test_release_uses_no_attempt(self, harness: StoreHarness) -> None:
        enqueued(harness, "a")
        claim = harness.store.claim(10, LONG)
        (row,) = claim.messages
        settlement = Settlement(release=(release(row, LEASE, "outage"),))
        assert harness.store.settle(claim.token, settlement) == SettleReport(released=1)
        assert harness.state(row.id) == (0, "outage")
        assert harness.store.claim(10, LONG).messages == ()
        harness.wait(PAST_LEASE)
        again = harness.store.claim(10, LONG).messages
        assert [(m.id, m.attempts) for m in again] == [(row.id, 0)]

    def test_dead_letter_keeps_the_message_the_attempts_and_the_reason(
        self, harness: StoreHarness
    ) -> None:
        (sent,) = enqueued(harness, "poison")
        claim = harness.store.claim(10, LONG)
        (row,) = claim.messages
        harness.store.settle(claim.token, Settlement(retry=(retry(row, 0.0, "x"),)))
        claim = harness.store.claim(10, LONG)
        reason = "PreconditionFailed: too large"
        settlement = Settlement(dead_letter=(dead_letter(claim.messages[0], reason),))
        report = harness.store.settle(claim.token, settlement)
        assert report == SettleReport(dead_lettered=1)
        assert harness.pending() == 0
        assert harness.dead_letters() == [
            DeadView(row.id, sent.task_id, sent.body, 2, reason)
        ]
        assert harness.store.claim(10, LONG).messages == ()

    def test_a_lost_lease_can_neither_settle_nor_dead_letter(
        self, harness: StoreHarness
    ) -> None:
        enqueued(harness, "a", "b", "c", "d")
        lost = harness.store.claim(10, LEASE)
        harness.wait(PAST_LEASE)
        held = harness.store.claim(10, LONG)

        def every_kind(messages: Sequence[StoredMessage]) -> Settlement:
            a, b, c, d = messages
            return Settlement(
                delete=(a.id,),
                retry=(retry(b, 0.0, "refused"),),
                release=(release(c),),
                dead_letter=(dead_letter(d, "poison"),),
            )

        assert harness.store.settle(lost.token, every_kind(lost.messages)) == (
            SettleReport()
        )
        assert harness.pending() == 4
        assert harness.dead_letters() == []
        assert [harness.state(m.id) for m in held.messages] == [(0, "")] * 4
        assert harness.store.settle(
            held.token, every_kind(held.messages)
        ) == SettleReport(1, 1, 1, 1)

    def test_an_ended_lease_nobody_took_over_still_settles(
        self, harness: StoreHarness
    ) -> None:
        # A relay whose settlement was late (a database error, a slow batch) may
        # still settle what no other relay has claimed since.
        enqueued(harness, "a", "b")
        claim = harness.store.claim(10, LEASE)
        harness.wait(PAST_LEASE)
        a, b = claim.messages
        assert harness.store.renew(claim.token, [b.id], LONG) == 1
        assert harness.store.settle(
            claim.token, Settlement(delete=(a.id,))
        ) == SettleReport(deleted=1)
        assert harness.store.claim(10, LONG).messages == ()
        assert harness.pending() == 1

    def test_a_wrong_token_changes_nothing(self, harness: StoreHarness) -> None:
        enqueued(harness, "a")
        claim = harness.store.claim(10, LONG)
        (row,) = claim.messages
        settlement = Settlement(delete=(row.id,), dead_letter=(dead_letter(row, "x"),))
        assert harness.store.settle("not-the-token", settlement) == SettleReport()
        assert harness.pending() == 1
        assert harness.dead_letters() == []

    def test_renew_extends_only_rows_our_lease_holds(
        self, harness: StoreHarness
    ) -> None:
        _, b = enqueued(harness, "a", "b")
        claim = harness.store.claim(1, LEASE)
        (row,) = claim.messages
        other = harness.store.claim(1, LEASE)
        ids = [row.id, other.messages[0].id]
        assert harness.store.renew("not-the-token", ids, LONG) == 0
        assert harness.store.renew(claim.token, ids, LONG) == 1
        harness.wait(PAST_LEASE)
        assert task_ids(harness.store.claim(10, LONG).messages) == [b.task_id]

    def test_task_ids_restrict_the_claim(self, harness: StoreHarness) -> None:
        a, b, c = enqueued(harness, "a", "b", "c")
        only = harness.store.claim(10, LONG, task_ids=[b.task_id, "unknown"])
        assert task_ids(only.messages) == [b.task_id]
        assert task_ids(harness.store.claim(10, LONG).messages) == [
            a.task_id,
            c.task_id,
        ]

    def test_an_empty_settlement_reports_nothing(self, harness: StoreHarness) -> None:
        enqueued(harness, "a")
        claim = harness.store.claim(10, LONG)
        assert harness.store.settle(claim.token, Settlement()) == SettleReport()
        assert harness.store.renew(claim.token, [], LONG) == 0
        assert harness.pending() == 1


class EnqueueHarness(StoreHarness, Protocol):
    """A backend's enqueue writer, beside the relay's store that reads its rows back."""

    writer: EnqueueStore

    def transaction(self) -> AbstractContextManager[object]:
        """The caller's transaction the writer writes in (committed on exit)."""
        ...


class EnqueueContract:
    """Tests every enqueue writer must pass; the runner provides ``harness``."""

    def test_rows_are_written_due_at_once_whole_and_in_order(
        self, harness: EnqueueHarness
    ) -> None:
        sent = [envelope("a", headers={"id": "a", "n": 1}), envelope("b")]
        with harness.transaction():
            harness.writer.insert(sent)
        claimed = harness.store.claim(10, LONG).messages
        assert [m.envelope for m in claimed] == sent
        assert [m.attempts for m in claimed] == [0, 0]
        assert [harness.state(m.id) for m in claimed] == [(0, "")] * 2

    def test_an_empty_write_writes_nothing(self, harness: EnqueueHarness) -> None:
        with harness.transaction():
            harness.writer.insert([])
        assert harness.pending() == 0

    def test_the_wake_up_hint_changes_nothing_a_relay_reads(
        self, harness: EnqueueHarness
    ) -> None:
        sent = [envelope("hinted")]
        with harness.transaction():
            harness.writer.insert(sent, notify=True)
        assert [m.envelope for m in harness.store.claim(10, LONG).messages] == sent
