"""The store contract, run against PostgreSQL, MariaDB and SQLite alike."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from django.db import connections, transaction

from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import Stores
from celery_outbox.store.base import StoreBase

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


def committed(store: StoreBase, *tags: str) -> list[str]:
    envelopes = [envelope(tag) for tag in tags]
    with transaction.atomic(using=store.alias):
        Stores(store.alias).writer().insert(envelopes)
    return [e.task_id for e in envelopes]


def test_a_rolled_back_insert_leaves_nothing(alias: str) -> None:
    store = Stores(alias).relay()
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        Stores(alias).writer().insert([envelope("lost")])
        raise RuntimeError("rollback")
    assert store.claim(10, 30).messages == ()
    assert Stores(alias).operator().stats().pending == 0


def test_a_bulk_insert_past_the_drivers_parameter_limits_writes_every_row(
    alias: str,
) -> None:
    """3,000 rows x 15 values: more than one statement may carry on SQLite."""
    store = Stores(alias).relay()
    sent = [
        envelope(f"bulk-{n}", headers={"id": f"bulk-{n}", "n": n}) for n in range(3000)
    ]
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(sent)
    claimed = store.claim(5000, 30).messages
    assert [m.envelope.task_id for m in claimed] == [e.task_id for e in sent]
    assert claimed[-1].envelope == sent[-1]


def test_claim_returns_the_whole_message_oldest_first(alias: str) -> None:
    store = Stores(alias).relay()
    sent = envelope(
        "a", headers={"id": "x", "eta": datetime(2030, 1, 2, tzinfo=timezone.utc)}
    )
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert([sent, envelope("b"), envelope("c")])
    claim = store.claim(2, 30)
    assert [m.envelope.task_id for m in claim.messages] == [
        sent.task_id,
        claim.messages[1].envelope.task_id,
    ]
    first = claim.messages[0]
    assert first.envelope == sent
    assert first.attempts == 0
    assert isinstance(first.envelope.body, bytes)


def test_a_lease_keeps_other_relays_away_until_it_ends(alias: str) -> None:
    store = Stores(alias).relay()
    ids = committed(store, "a", "b")
    first = store.claim(10, 0.5)
    assert sorted(m.envelope.task_id for m in first.messages) == sorted(ids)
    assert store.claim(10, 30).messages == ()
    stats = Stores(alias).operator().stats()
    assert (stats.pending, stats.due, stats.in_flight) == (2, 0, 2)
    time.sleep(0.7)
    second = store.claim(10, 30)
    assert sorted(m.envelope.task_id for m in second.messages) == sorted(ids)
    # The first relay lost its lease: everything it writes now is fenced off.
    stale = Settlement(delete=tuple(m.id for m in first.messages))
    assert store.settle(first.token, stale).deleted == 0
    assert Stores(alias).operator().stats().pending == 2
    assert (
        store.settle(
            second.token, Settlement(delete=tuple(m.id for m in second.messages))
        ).deleted
        == 2
    )
    assert Stores(alias).operator().stats().pending == 0


def test_retry_counts_the_attempt_and_waits(alias: str) -> None:
    store = Stores(alias).relay()
    committed(store, "a")
    claim = store.claim(10, 30)
    row = claim.messages[0]
    report = store.settle(
        claim.token,
        Settlement(retry=(Decision(row.id, Action.RETRY, 0.4, "NotFound: boom"),)),
    )
    assert report.retried == 1
    assert store.claim(10, 30).messages == ()
    saved = OutboxMessage.objects.using(alias).get(id=row.id)
    assert (saved.attempts, saved.last_error, saved.lease_token) == (
        1,
        "NotFound: boom",
        None,
    )
    time.sleep(0.6)
    again = store.claim(10, 30).messages
    assert [(m.id, m.attempts) for m in again] == [(row.id, 1)]


def test_release_keeps_the_attempts(alias: str) -> None:
    store = Stores(alias).relay()
    committed(store, "a")
    claim = store.claim(10, 30)
    row = claim.messages[0]
    store.settle(
        claim.token,
        Settlement(release=(Decision(row.id, Action.RELEASE, 0.0, "outage"),)),
    )
    again = store.claim(10, 30).messages
    assert [(m.id, m.attempts) for m in again] == [(row.id, 0)]


def test_dead_letter_keeps_the_whole_message_and_the_reason(alias: str) -> None:
    store = Stores(alias).relay()
    committed(store, "poison")
    claim = store.claim(10, 30)
    row = claim.messages[0]
    report = store.settle(
        claim.token,
        Settlement(
            dead_letter=(
                Decision(
                    row.id, Action.DEAD_LETTER, 0.0, "PreconditionFailed: too large"
                ),
            )
        ),
    )
    assert report.dead_lettered == 1
    assert Stores(alias).operator().stats().pending == 0
    assert Stores(alias).operator().stats().dead == 1
    dead = DeadLetter.objects.using(alias).get()
    assert dead.original_id == row.id
    assert dead.task_id == row.envelope.task_id
    assert bytes(dead.body) == row.envelope.body
    assert (dead.attempts, dead.last_error) == (1, "PreconditionFailed: too large")
    assert dead.dead_at >= dead.created_at


def test_a_lost_lease_cannot_dead_letter(alias: str) -> None:
    store = Stores(alias).relay()
    committed(store, "a")
    claim = store.claim(10, 30)
    decision = Decision(claim.messages[0].id, Action.DEAD_LETTER, 0.0, "x")
    assert (
        store.settle("not-the-token", Settlement(dead_letter=(decision,))).dead_lettered
        == 0
    )
    assert Stores(alias).operator().stats().dead == 0
    assert Stores(alias).operator().stats().pending == 1


def test_renew_extends_only_our_lease(alias: str) -> None:
    store = Stores(alias).relay()
    committed(store, "a")
    claim = store.claim(10, 0.3)
    ids = [m.id for m in claim.messages]
    assert store.renew("other", ids, 30) == 0
    assert store.renew(claim.token, ids, 30) == 1
    time.sleep(0.5)
    assert store.claim(10, 30).messages == ()


def test_stats_report_backlog_and_age(alias: str) -> None:
    store = Stores(alias).operator()
    assert store.stats().as_dict() == {
        "pending": 0,
        "due": 0,
        "in_flight": 0,
        "dead": 0,
        "oldest_pending_seconds": None,
        "scheduled": 0,
        "next_due_seconds": None,
    }
    committed(store, "a", "b", "c")
    time.sleep(0.3)
    stats = store.stats()
    assert (stats.pending, stats.due, stats.dead) == (3, 3, 0)
    assert stats.oldest_pending_seconds is not None
    assert 0.2 <= stats.oldest_pending_seconds < 30


def test_rows_of_a_newer_payload_version_are_refused_loudly(alias: str) -> None:
    store = Stores(alias).relay()
    committed(store, "future")
    OutboxMessage.objects.using(alias).update(payload_version=99)
    claim = store.claim(10, 30)
    assert claim.messages == ()
    assert len(claim.unreadable) == 1
    assert "payload version 99" in claim.unreadable[0].error


@pytest.mark.parametrize("alias", ["default", "mysql"])
def test_concurrent_claims_never_share_a_row(alias: str) -> None:
    store = Stores(alias).relay()
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert([envelope(f"r{i}") for i in range(400)])
    seen: list[list[int]] = [[], [], [], []]
    errors: list[BaseException] = []

    def drain(slot: int) -> None:
        try:
            while True:
                claim = store.claim(25, 30)
                if not claim.messages:
                    return
                seen[slot].extend(m.id for m in claim.messages)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections[alias].close()

    threads = [threading.Thread(target=drain, args=(slot,)) for slot in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    everything = [row for rows in seen for row in rows]
    assert len(everything) == 400
    assert len(set(everything)) == 400


def test_each_outcome_kind_is_one_statement_with_per_row_values(alias: str) -> None:
    from django.test.utils import CaptureQueriesContext

    store = Stores(alias).relay()
    committed(store, *[f"m{i}" for i in range(6)])
    claim = store.claim(10, 30)
    ids = [m.id for m in claim.messages]
    settlement = Settlement(
        retry=(
            Decision(ids[0], Action.RETRY, 0.0, "first"),
            Decision(ids[1], Action.RETRY, 600.0, "second"),
        ),
        release=(Decision(ids[2], Action.RELEASE, 0.0, "outage"),),
        dead_letter=(
            Decision(ids[3], Action.DEAD_LETTER, 0.0, "too large"),
            Decision(ids[4], Action.DEAD_LETTER, 0.0, "no exchange"),
        ),
        delete=(ids[5],),
    )
    with CaptureQueriesContext(connections[alias]) as queries:
        report = store.settle(claim.token, settlement)
    assert (report.retried, report.released, report.dead_lettered, report.deleted) == (
        2,
        1,
        2,
        1,
    )
    updates = [q for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 2  # one for the retries, one for the release
    rows = {r.id: r for r in OutboxMessage.objects.using(alias)}
    assert (rows[ids[0]].attempts, rows[ids[0]].last_error) == (1, "first")
    assert (rows[ids[1]].attempts, rows[ids[1]].last_error) == (1, "second")
    assert rows[ids[1]].available_at - rows[ids[0]].available_at > timedelta(
        seconds=590
    )
    assert (rows[ids[2]].attempts, rows[ids[2]].last_error) == (0, "outage")
    dead = dict(
        DeadLetter.objects.using(alias).values_list("original_id", "last_error")
    )
    assert dead == {ids[3]: "too large", ids[4]: "no exchange"}
    assert set(rows) == {ids[0], ids[1], ids[2]}
