"""The contracts of the roles only a database implements: ordered keys' heads, history,
relay heartbeats, ``dedup_key`` holds and event retries.

Each suite is written against its protocol (:mod:`celery_outbox.store.protocol`) and a
:class:`RoleHarness`; ``tests/integration/test_store_contract.py`` runs them on every
database alias. An in-memory twin of one of these roles would run them too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from celery_outbox.envelope import Envelope
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.ordering_options import Policy
from celery_outbox.outcomes import Settlement
from celery_outbox.store import (
    DedupStore,
    EnqueueStore,
    EventStore,
    HistoryStore,
    OrderingStore,
    RegistryStore,
    RelayStore,
)

from ..integration.builders import envelope, keyed
from .store_contract import LEASE, LONG, PAST_LEASE, dead_letter, retry, task_ids

#: The heartbeat id the harness's relay claims for.
HOLDER = "relay-1"


class RoleHarness(Protocol):
    """One backend's roles on one outbox, history on, the relay claiming for HOLDER."""

    relay: RelayStore
    writer: EnqueueStore
    ordering: OrderingStore
    history: HistoryStore
    dedup: DedupStore
    events: EventStore

    def registry(self, holder: str) -> RegistryStore:
        """The heartbeats of the relay ``holder``."""
        ...

    def relay_for(self, holder: str) -> RelayStore:
        """The store of a relay that claims for ``holder``."""
        ...

    def transaction(self) -> AbstractContextManager[object]:
        """A transaction of the caller's (committed on exit)."""
        ...

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock."""
        ...

    def dead_task_ids(self) -> list[str]:
        """The task ids of the dead letters, oldest first."""
        ...


def write(harness: RoleHarness, *envelopes: Envelope) -> list[str]:
    with harness.transaction():
        harness.writer.insert(envelopes)
    return [e.task_id for e in envelopes]


def block_head(harness: RoleHarness, error: str = "NotFound: q") -> None:
    """Claim the head alone and have the broker refuse it for good: its key blocks."""
    claim = harness.relay.claim(1, LONG)
    failed = Settlement(dead_letter=(dead_letter(claim.messages[0], error),))
    harness.relay.settle(claim.token, ordered_settlement(failed, claim.messages, LONG))


def publish_all(harness: RoleHarness) -> tuple[str, ...]:
    """Claim what is due and settle it as published (strict heads stay running)."""
    claim = harness.relay.claim(10, LONG)
    published = Settlement(delete=tuple(m.id for m in claim.messages))
    harness.relay.settle(
        claim.token, ordered_settlement(published, claim.messages, LONG)
    )
    return tuple(task_ids(claim.messages))


class OrderingContract:
    """Ordered keys' heads: what the strict worker and the operators rely on."""

    def test_a_blocked_head_is_listed_until_an_operator_retries_it(
        self, roles: RoleHarness
    ) -> None:
        head, follower = write(roles, keyed("a0", "A"), keyed("a1", "A"))
        block_head(roles, "NotFound: q")

        (blocked,) = roles.ordering.blocked_heads()
        stats = roles.ordering.ordering_stats()

        assert (blocked.key, blocked.task_id, blocked.last_error) == (
            "A",
            head,
            "NotFound: q",
        )
        assert blocked.rows == 2
        assert blocked.blocked_seconds is not None and blocked.blocked_seconds >= 0
        assert (stats.keys, stats.keyed_rows, stats.blocked) == (1, 2, (blocked,))
        assert roles.relay.claim(10, LONG).messages == ()
        assert roles.ordering.retry_head("B") == 0
        assert roles.ordering.retry_head("A") == 1
        again = roles.relay.claim(10, LONG).messages  # the head, then a run of A
        assert [(m.envelope.task_id, m.attempts) for m in again] == [
            (head, 0),
            (follower, 0),
        ]

    def test_skipping_a_blocked_head_moves_its_key_on(self, roles: RoleHarness) -> None:
        first, second, third = write(
            roles, keyed("a0", "A"), keyed("a1", "A"), keyed("a2", "A")
        )
        block_head(roles)
        assert roles.ordering.dead_letter_head("A") == 1
        assert roles.dead_task_ids() == [first]
        block_head(roles)
        assert roles.ordering.skip_head("A", dead_letter=False) == 1
        assert roles.dead_task_ids() == [first]
        assert task_ids(roles.relay.claim(10, LONG).messages) == [third]
        assert roles.ordering.skip_head("A") == 0
        assert second not in roles.dead_task_ids()

    def test_a_strict_head_holds_its_key_until_its_worker_reports(
        self, roles: RoleHarness
    ) -> None:
        head, follower = write(
            roles, keyed("s0", "S", "strict"), keyed("s1", "S", "strict")
        )
        assert publish_all(roles) == (head,)
        assert roles.ordering.task_retrying(head, LONG) == 1
        assert roles.ordering.ordering_stats().running == 1
        assert roles.relay.claim(10, LONG).messages == ()

        assert roles.ordering.task_done(head) == 1

        assert publish_all(roles) == (follower,)
        assert roles.ordering.task_done("unknown-task") == 0

    def test_a_strict_task_that_failed_for_good_follows_its_policy(
        self, roles: RoleHarness
    ) -> None:
        blocking, _, skipping, after = write(
            roles,
            keyed("b0", "B", "strict"),
            keyed("b1", "B", "strict"),
            keyed("k0", "K", "strict,skip"),
            keyed("k1", "K", "strict,skip"),
        )
        publish_all(roles)

        assert roles.ordering.task_failed(blocking, "ValueError: b", Policy.BLOCK) == 1
        assert roles.ordering.task_failed(skipping, "ValueError: k", Policy.SKIP) == 1

        assert [h.task_id for h in roles.ordering.blocked_heads()] == [blocking]
        assert roles.dead_task_ids() == [skipping]
        assert publish_all(roles) == (after,)


class HistoryContract:
    """Where a message is and what happened to it, and the history's retention."""

    def test_a_trace_follows_a_message_from_retry_to_dead_letter(
        self, roles: RoleHarness
    ) -> None:
        roles.history.check_history()
        assert not roles.history.trace("never-enqueued").found
        (task_id,) = write(roles, envelope("a"))
        (row,) = roles.history.trace(task_id).rows
        assert (row.state, row.attempts) == ("due", 0)

        claim = roles.relay.claim(1, LONG)
        roles.relay.settle(
            claim.token,
            Settlement(retry=(retry(claim.messages[0], LONG, "NotFound: q"),)),
        )
        retrying = roles.history.trace(task_id)
        assert [(r.state, r.attempts, r.last_error) for r in retrying.rows] == [
            ("retrying", 1, "NotFound: q")
        ]
        assert [(e.event, e.attempt, e.relay_id) for e in retrying.events] == [
            ("retrying", 1, HOLDER)
        ]

    def test_a_dead_letter_is_traced_and_old_events_are_purged(
        self, roles: RoleHarness
    ) -> None:
        (task_id,) = write(roles, envelope("poison"))
        claim = roles.relay.claim(1, LONG)
        roles.relay.settle(
            claim.token,
            Settlement(dead_letter=(dead_letter(claim.messages[0], "too big"),)),
        )
        trace = roles.history.trace(task_id)
        assert (trace.rows, [d.last_error for d in trace.dead]) == ((), ["too big"])
        assert [e.event for e in trace.events] == ["dead"]

        assert roles.history.purge_history(LONG) == 0
        roles.wait(PAST_LEASE)
        assert roles.history.purge_history(LEASE, chunk_size=1) == 1
        assert roles.history.trace(task_id).events == ()


class RegistryContract:
    """Relay heartbeats, and the takeover of a silent relay's leases."""

    def test_a_silent_relays_leases_end_at_the_next_takeover(
        self, roles: RoleHarness
    ) -> None:
        silent, live = roles.registry("silent"), roles.registry("live")
        assert silent.holder == "silent"
        write(roles, envelope("a"), envelope("b"))
        silent.beat("silent", "host:1")
        assert len(roles.relay_for("silent").claim(10, LONG).messages) == 2
        roles.wait(PAST_LEASE)
        live.beat("live", "host:2")

        assert live.take_over(LEASE) == 2

        assert len(roles.relay_for("live").claim(10, LONG).messages) == 2
        assert live.take_over(LEASE) == 0

    def test_a_live_or_departed_relay_is_not_taken_over(
        self, roles: RoleHarness
    ) -> None:
        busy, other = roles.registry("busy"), roles.registry("other")
        write(roles, envelope("a"))
        busy.beat("busy", "host:1")
        roles.relay_for("busy").claim(10, LONG)
        other.beat("other", "host:2")
        assert other.take_over(LONG) == 0
        busy.leave("busy")
        roles.wait(PAST_LEASE)
        other.beat("other", "host:2")
        # Gone cleanly: no heartbeat left to find stale, its lease runs its course.
        assert other.take_over(LEASE) == 0
        assert roles.relay.claim(10, LONG).messages == ()


class DedupContract:
    """Keys that refuse a second enqueue while the first task holds them."""

    def test_a_held_key_refuses_the_next_task_naming_the_holder(
        self, roles: RoleHarness
    ) -> None:
        first = envelope("first", dedup_key="invoice:42", dedup_window=LONG)
        second = envelope("second", dedup_key="invoice:42", dedup_window=LONG)
        other = envelope("other", dedup_key="invoice:43", dedup_window=LONG)
        with roles.transaction():
            assert roles.dedup.hold_keys([first, other]) == {}
        with roles.transaction():
            refused = roles.dedup.hold_keys([second])
        assert refused == {second.task_id: first.task_id}

    def test_an_ended_hold_is_taken_again_and_purged(self, roles: RoleHarness) -> None:
        first = envelope("first", dedup_key="report", dedup_window=LEASE)
        with roles.transaction():
            roles.dedup.hold_keys([first])
        assert roles.dedup.purge_dedup_keys() == 0  # its window has not passed
        roles.wait(PAST_LEASE)
        assert roles.dedup.purge_dedup_keys(chunk_size=1) == 1
        second = envelope("second", dedup_key="report", dedup_window=LEASE)
        with roles.transaction():
            assert roles.dedup.hold_keys([second]) == {}
        write(roles, second)
        roles.wait(PAST_LEASE)
        # Its window passed, but its row still waits to be published: still held.
        third = envelope("third", dedup_key="report", dedup_window=LEASE)
        with roles.transaction():
            assert roles.dedup.hold_keys([third]) == {third.task_id: second.task_id}
        assert roles.dedup.purge_dedup_keys() == 0


def routed(tag: str, prefix: str) -> Envelope:
    return envelope(tag, routing_key=f"{prefix}{tag}", headers={"event": "order.paid"})


class EventContract:
    """Event retries the database holds, and a service's archive of dead events."""

    def test_a_retry_waits_out_its_delay(self, roles: RoleHarness) -> None:
        sent = routed("retry", "events:billing:")
        with roles.transaction():
            roles.events.insert_later([sent], LEASE)
        assert roles.events.waiting_retries("events:billing:") == 1
        assert roles.events.waiting_retries("events:mail:") == 0
        assert roles.relay.claim(10, LONG).messages == ()
        roles.wait(PAST_LEASE)
        assert [m.envelope for m in roles.relay.claim(10, LONG).messages] == [sent]

    def test_the_archive_lists_a_services_dead_events(self, roles: RoleHarness) -> None:
        billing = [routed(tag, "events:billing:") for tag in ("a", "b")]
        with roles.transaction():
            roles.events.insert_dead(billing, "ValueError: boom")
            roles.events.insert_dead([routed("c", "events:mail:")], "KeyError")

        found = roles.events.dead_events("events:billing:")

        assert [(e.task_id, e.routing_key, e.last_error) for e in found] == [
            (sent.task_id, sent.routing_key, "ValueError: boom") for sent in billing
        ]
        assert found[0].headers["event"] == "order.paid"
        assert len(roles.events.dead_events("events:billing:", limit=1)) == 1
        assert roles.events.count_dead_events("events:billing:") == 2
        assert roles.events.count_dead_events("events:") == 3
        assert roles.relay.claim(10, LONG).messages == ()
