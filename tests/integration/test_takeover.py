"""A dead relay's leases end when its heartbeat goes stale, not when the lease runs out."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from celery_outbox.engine.heartbeat import Heartbeat
from celery_outbox.models import OutboxMessage, RelayHeartbeat
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import Stores

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

LEASE = 60.0
STALE = 6.0


def committed(store: Stores, count: int) -> None:
    with transaction.atomic(using=store.alias):
        store.writer().insert([envelope(f"t{n}") for n in range(count)])


def silent_for(alias: str, relay_id: str, seconds: float) -> None:
    """Make ``relay_id``'s last heartbeat ``seconds`` old, as if it died then."""
    RelayHeartbeat.objects.using(alias).filter(id=relay_id).update(
        seen_at=timezone.now() - timedelta(seconds=seconds)
    )


def relays(alias: str) -> set[str]:
    return set(RelayHeartbeat.objects.using(alias).values_list("id", flat=True))


def test_a_dead_relays_rows_are_claimable_at_once(alias: str) -> None:
    dead, live = Stores(alias, holder="dead"), Stores(alias, holder="live")
    committed(dead, 5)
    dead.registry().beat("dead", "host:1")
    claim = dead.relay().claim(10, LEASE)
    assert len(claim.messages) == 5
    live.registry().beat("live", "host:2")
    assert live.relay().claim(10, LEASE).messages == ()
    silent_for(alias, "dead", 2 * STALE)

    assert live.registry().take_over(STALE) == 5
    taken = live.relay().claim(10, LEASE)
    assert sorted(m.id for m in taken.messages) == sorted(m.id for m in claim.messages)
    assert relays(alias) == {"live"}
    assert set(OutboxMessage.objects.using(alias).values_list("holder", flat=True)) == {
        "live"
    }


def test_the_dead_relays_late_settlement_changes_nothing(alias: str) -> None:
    dead, live = Stores(alias, holder="dead"), Stores(alias, holder="live")
    committed(dead, 3)
    dead.registry().beat("dead", "host:1")
    claim = dead.relay().claim(10, LEASE)
    silent_for(alias, "dead", 2 * STALE)
    live.registry().take_over(STALE)
    taken = live.relay().claim(10, LEASE)
    ids = [m.id for m in claim.messages]

    report = dead.relay().settle(
        claim.token,
        Settlement(
            delete=ids[:1],
            retry=(Decision(ids[1], Action.RETRY, 5.0, "late"),),
            dead_letter=(Decision(ids[2], Action.DEAD_LETTER, 0.0, "late"),),
        ),
    )
    assert (report.deleted, report.retried, report.dead_lettered) == (0, 0, 0)
    rows = OutboxMessage.objects.using(alias)
    assert set(rows.values_list("lease_token", flat=True)) == {taken.token}
    assert set(rows.values_list("attempts", flat=True)) == {0}


def test_a_fresh_heartbeat_keeps_the_rows(alias: str) -> None:
    slow, other = Stores(alias, holder="slow"), Stores(alias, holder="other")
    committed(slow, 4)
    slow.registry().beat("slow", "host:1")
    slow.relay().claim(10, LEASE)
    silent_for(alias, "slow", STALE / 3)
    other.registry().beat("other", "host:2")

    assert other.registry().take_over(STALE) == 0
    assert other.relay().claim(10, LEASE).messages == ()
    assert relays(alias) == {"slow", "other"}


def test_a_retry_delay_and_rows_without_a_holder_are_left_alone(alias: str) -> None:
    dead, live = Stores(alias, holder="dead"), Stores(alias, holder="live")
    committed(dead, 2)
    dead.registry().beat("dead", "host:1")
    retried = dead.relay().claim(1, LEASE)
    dead.relay().settle(
        retried.token,
        Settlement(retry=(Decision(retried.messages[0].id, Action.RETRY, 300.0, "x"),)),
    )
    # Publish-on-commit (and rows leased by an older version) claim with no holder.
    assert len(Stores(alias).relay().claim(10, LEASE).messages) == 1
    silent_for(alias, "dead", 2 * STALE)

    assert live.registry().take_over(STALE) == 0
    assert live.relay().claim(10, LEASE).messages == ()


def test_a_relay_taken_for_dead_comes_back_with_its_next_beat(alias: str) -> None:
    back, live = Stores(alias, holder="back"), Stores(alias, holder="live")
    back.registry().beat("back", "host:1")
    silent_for(alias, "back", 2 * STALE)
    live.registry().take_over(STALE)
    assert relays(alias) == set()
    back.registry().beat("back", "host:1")
    assert relays(alias) == {"back"}
    back.registry().leave("back")
    assert relays(alias) == set()


def test_the_heartbeat_thread_keeps_a_slow_relay_alive(alias: str) -> None:
    """The loop is busy (here: doing nothing at all); the thread beats for it."""
    store, other = Stores(alias, holder="busy"), Stores(alias, holder="x")
    committed(store, 3)
    woken: list[bool] = []
    heartbeat = Heartbeat(store.registry(), 0.2, on_takeover=lambda: woken.append(True))
    heartbeat.start()
    try:
        store.relay().claim(10, LEASE)
        time.sleep(1.5)  # over twice the 0.6 s it may stay silent
        assert other.registry().take_over(heartbeat.stale_seconds) == 0
        assert relays(alias) == {"busy"}
    finally:
        heartbeat.stop()
    assert relays(alias) == set()
    assert woken == []
    assert OutboxMessage.objects.using(alias).filter(holder="busy").count() == 3


def test_the_heartbeat_takes_over_and_wakes_the_loop(alias: str) -> None:
    dead, live = Stores(alias, holder="dead"), Stores(alias, holder="live")
    committed(dead, 2)
    dead.registry().beat("dead", "host:1")
    dead.relay().claim(10, LEASE)
    silent_for(alias, "dead", 2 * STALE)
    woken: list[bool] = []
    heartbeat = Heartbeat(
        live.registry(), STALE / 3, on_takeover=lambda: woken.append(True)
    )

    assert heartbeat.beat() == 2
    assert woken == [True]
    assert len(live.relay().claim(10, LEASE).messages) == 2
