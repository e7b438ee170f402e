"""Ordered keys on every database: the head rule, runs, strict heads, coalescing, policies."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from django.db import connections, transaction

from celery_outbox.envelope import StoredMessage
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.ordering_options import Policy
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import Stores
from celery_outbox.store.store import RelayQueries

from .builders import keyed

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


def write(store: RelayQueries, *envelopes: Any) -> list[str]:
    with transaction.atomic(using=store.alias):
        Stores(store.alias).writer().insert(list(envelopes))
    return [e.task_id for e in envelopes]


def tags(messages: tuple[StoredMessage, ...]) -> list[str]:
    return [m.envelope.task_id.rsplit("-", 1)[0] for m in messages]


def publish(
    store: RelayQueries, messages: tuple[StoredMessage, ...], token: str
) -> None:
    """Settle as the relay does after every message was published."""
    settlement = ordered_settlement(
        Settlement(delete=tuple(m.id for m in messages)), messages, 300.0
    )
    store.settle(token, settlement)


def test_only_the_head_of_a_key_is_claimed_while_it_is_leased(alias: str) -> None:
    store = Stores(alias).relay()
    write(
        store, keyed("a1", "A"), keyed("u1", None), keyed("a2", "A"), keyed("b1", "B")
    )
    first = store.claim(2, 30)
    assert tags(first.messages) == ["a1", "u1"]  # a2 waits behind its head
    second = store.claim(10, 30)
    assert tags(second.messages) == ["b1"]  # a1 is leased: A gives nothing
    publish(store, first.messages, first.token)
    assert tags(store.claim(10, 30).messages) == ["a2"]


def test_a_claim_takes_a_run_of_a_key_in_id_order(alias: str) -> None:
    store = Stores(alias).relay()
    write(store, *(keyed(f"a{n}", "A") for n in range(5)), keyed("b0", "B"))
    claim = store.claim(4, 30)
    # The heads first (a0, b0), then a0's followers while the batch has room.
    assert tags(claim.messages) == ["a0", "a1", "a2", "b0"]
    assert store.claim(10, 30).messages == ()  # a3 waits behind rows in flight
    publish(store, claim.messages, claim.token)
    assert tags(store.claim(10, 30).messages) == ["a3", "a4"]


def test_a_strict_head_stays_running_until_its_worker_reports(alias: str) -> None:
    store = Stores(alias).relay()
    ids = write(store, *(keyed(f"s{n}", "S", "strict") for n in range(3)))
    claim = store.claim(10, 30)
    assert tags(claim.messages) == ["s0"]  # no run behind a strict row
    publish(store, claim.messages, claim.token)
    assert OutboxMessage.objects.using(alias).get(task_id=ids[0]).state == "running"
    assert store.claim(10, 30).messages == ()
    assert Stores(alias).ordering().task_done(ids[0]) == 1
    assert tags(store.claim(10, 30).messages) == ["s1"]


def test_a_worker_may_report_before_the_relay_settles(alias: str) -> None:
    store = Stores(alias).relay()
    ids = write(store, keyed("s0", "S", "strict"), keyed("s1", "S", "strict"))
    claim = store.claim(10, 30)
    # The task ran before the settlement.
    assert Stores(alias).ordering().task_done(ids[0]) == 1
    publish(store, claim.messages, claim.token)
    assert tags(store.claim(10, 30).messages) == ["s1"]


def test_a_run_stops_after_a_strict_row(alias: str) -> None:
    store = Stores(alias).relay()
    write(store, keyed("p0", "K"), keyed("p1", "K", "strict"), keyed("p2", "K"))
    assert tags(store.claim(10, 30).messages) == ["p0", "p1"]


def test_a_killed_workers_head_is_claimed_again_after_its_running_lease(
    alias: str,
) -> None:
    store = Stores(alias).relay()
    ids = write(store, keyed("s0", "S", "strict"), keyed("s1", "S", "strict"))
    claim = store.claim(10, 30)
    store.settle(
        claim.token,
        ordered_settlement(
            Settlement(delete=(claim.messages[0].id,)), claim.messages, 0.5
        ),
    )
    assert store.claim(10, 30).messages == ()
    time.sleep(0.8)
    again = store.claim(10, 30)
    assert [m.envelope.task_id for m in again.messages] == [ids[0]]


def test_coalescing_publishes_only_the_newest_row_of_each_object(alias: str) -> None:
    store = Stores(alias).relay()
    updates = [
        keyed(f"o{n % 10}v{n // 10}", f"obj:{n % 10}", "coalesce") for n in range(200)
    ]
    write(store, *updates, keyed("other", "obj:0", "", task="shop.other"))
    claimed: list[StoredMessage] = []
    coalesced = 0
    for _ in range(5):  # a coalesced head leaves its newest row for the next claim
        claim = store.claim(500, 30)
        coalesced += len(claim.coalesced)
        claimed.extend(claim.messages)
        publish(store, claim.messages, claim.token)
    names = sorted(m.envelope.task_id.rsplit("-", 1)[0] for m in claimed)
    assert names == sorted([f"o{n}v19" for n in range(10)] + ["other"])
    assert coalesced == 190
    assert OutboxMessage.objects.using(alias).count() == 0


def test_a_blocked_head_holds_only_its_key_until_an_operator_acts(alias: str) -> None:
    store = Stores(alias).relay()
    write(store, keyed("a0", "A"), keyed("a1", "A"), keyed("b0", "B"), keyed("b1", "B"))
    claim = store.claim(1, 30)  # a0 alone
    failed = Settlement(
        dead_letter=(Decision(claim.messages[0].id, Action.DEAD_LETTER, 0, "refused"),)
    )
    store.settle(claim.token, ordered_settlement(failed, claim.messages, 300.0))
    others = store.claim(10, 30)
    assert tags(others.messages) == ["b0", "b1"]  # A waits, B drains
    publish(store, others.messages, others.token)
    ordering = Stores(alias).ordering()
    (head,) = ordering.blocked_heads()
    assert (head.key, head.last_error, head.rows) == ("A", "refused", 2)
    assert ordering.ordering_stats().blocked == (head,)
    assert ordering.retry_head("A") == 1
    again = store.claim(1, 30)
    assert tags(again.messages) == ["a0"]
    store.settle(again.token, ordered_settlement(failed, again.messages, 300.0))
    assert ordering.skip_head("A") == 1
    assert DeadLetter.objects.using(alias).filter(ordering_key="A").count() == 1
    assert tags(store.claim(10, 30).messages) == ["a1"]


def test_a_skip_key_dead_letters_its_failed_head_and_moves_on(alias: str) -> None:
    store = Stores(alias).relay()
    write(store, keyed("a0", "A", "skip"), keyed("a1", "A", "skip"))
    claim = store.claim(1, 30)
    failed = Settlement(
        dead_letter=(Decision(claim.messages[0].id, Action.DEAD_LETTER, 0, "refused"),)
    )
    store.settle(claim.token, ordered_settlement(failed, claim.messages, 300.0))
    assert DeadLetter.objects.using(alias).count() == 1
    assert tags(store.claim(10, 30).messages) == ["a1"]


@pytest.mark.parametrize("policy", [Policy.BLOCK, Policy.SKIP])
def test_a_strict_task_that_failed_for_good_follows_its_policy(
    alias: str, policy: Policy
) -> None:
    store = Stores(alias).relay()
    flags = "strict" if policy is Policy.BLOCK else "strict,skip"
    ids = write(store, keyed("s0", "S", flags), keyed("s1", "S", flags))
    claim = store.claim(10, 30)
    publish(store, claim.messages, claim.token)
    ordering = Stores(alias).ordering()
    assert ordering.task_failed(ids[0], "ValueError: boom", policy) == 1
    if policy is Policy.BLOCK:
        assert store.claim(10, 30).messages == ()
        assert ordering.blocked_heads()[0].last_error == "ValueError: boom"
    else:
        assert DeadLetter.objects.using(alias).get().last_error == "ValueError: boom"
        assert tags(store.claim(10, 30).messages) == ["s1"]


def test_stats_count_keys_rows_and_the_deepest_keys(alias: str) -> None:
    store = Stores(alias).relay()
    write(
        store,
        *(keyed(f"h{n}", "hot") for n in range(5)),
        keyed("c0", "cold"),
        keyed("u", None),
    )
    stats = Stores(alias).ordering().ordering_stats(top=1)
    assert (stats.keys, stats.keyed_rows, stats.running) == (2, 6, 0)
    assert [(d.key, d.rows) for d in stats.deepest] == [("hot", 5)]
    assert stats.oldest_head_seconds is not None


def test_a_claim_in_progress_keeps_its_key_from_every_other_claim(alias: str) -> None:
    """The head is claimed in a transaction not yet committed; another claim runs."""
    store = Stores(alias).relay()
    if not store.dialect.concurrent_claims:
        pytest.skip("SQLite runs one relay")
    write(store, keyed("a0", "A"), keyed("a1", "A"), keyed("b0", "B"))
    seen: list[list[str]] = []

    def other() -> None:
        try:
            seen.append(tags(Stores(alias).relay().claim(10, 30).messages))
        finally:
            connections[alias].close()

    with transaction.atomic(using=alias):
        mine = store.claim(1, 30)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(60)
    assert tags(mine.messages) == ["a0"]
    assert seen == [["b0"]]


def test_concurrent_claims_never_hold_two_rows_of_a_key(alias: str) -> None:
    """Three claimers race over 40 keys x 6 rows: per key, one in flight, id order."""
    store = Stores(alias).relay()
    if not store.dialect.concurrent_claims:
        pytest.skip("SQLite runs one relay")
    write(store, *(keyed(f"k{n % 40}r{n // 40}", f"k{n % 40}") for n in range(240)))
    lock = threading.Lock()
    in_flight: set[str] = set()
    order: dict[str, list[int]] = defaultdict(list)
    problems: list[str] = []

    def claimer() -> None:
        mine = Stores(alias).relay()
        try:
            for _ in range(400):
                claim = mine.claim(7, 30)
                if not claim.messages:
                    if OutboxMessage.objects.using(alias).count() == 0:
                        return
                    continue
                keys = {m.envelope.ordering_key for m in claim.messages}
                with lock:
                    clash = keys & in_flight
                    if clash:
                        problems.append(f"two claims hold {sorted(map(str, clash))}")
                    in_flight.update(str(k) for k in keys)
                time.sleep(0.002)
                with lock:
                    in_flight.difference_update(str(k) for k in keys)
                    for m in claim.messages:
                        order[str(m.envelope.ordering_key)].append(m.id)
                mine.settle(
                    claim.token, Settlement(delete=tuple(m.id for m in claim.messages))
                )
        finally:
            connections[alias].close()

    threads = [threading.Thread(target=claimer) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert problems == []
    assert sum(len(ids) for ids in order.values()) == 240
    assert all(ids == sorted(ids) for ids in order.values())


def test_the_command_lists_and_skips_a_blocked_head(alias: str, settings: Any) -> None:
    from io import StringIO

    from django.core.management import call_command

    settings.CELERY_OUTBOX_DATABASE = alias
    store = Stores(alias).relay()
    write(store, keyed("a0", "A"), keyed("a1", "A"))
    claim = store.claim(1, 30)
    failed = Settlement(
        dead_letter=(Decision(claim.messages[0].id, Action.DEAD_LETTER, 0, "nope"),)
    )
    store.settle(claim.token, ordered_settlement(failed, claim.messages, 300.0))
    out = StringIO()
    call_command("outbox", "ordering", "stats", stdout=out)
    assert "blocked A: shop.record" in out.getvalue() and "nope" in out.getvalue()
    call_command("outbox", "ordering", "skip", "--key", "A", stdout=out)
    assert tags(store.claim(10, 30).messages) == ["a1"]
