"""The contract of the handler store (:class:`celery_outbox.store.handlers.HandlerLeases`).

``tests/unit/test_handler_store_memory.py`` runs it on the in-memory twin,
``tests/integration/test_handler_store_contract.py`` on every database. A suite
subclass gives the ``stores`` fixture: ``stores(holder)`` is a store of one shared
database for the processor ``holder``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import pytest

from celery_outbox.store.handlers import HandlerLeases, HandlerLeftover, LeaseLost


class PausingStore(HandlerLeases, Protocol):
    """A handler store that an operator can also pause (the kill switches)."""

    def pause(self, kind: str, value: str, reason: str = "") -> bool: ...


Stores = Callable[[str | None], PausingStore]
#: Long enough that no lease ends by itself during a test.
LONG = 60.0


def write(store: HandlerLeases, shard: str, *objects: str, category: str = "c") -> None:
    with store.atomic():
        for obj in objects:
            store.write(category, shard, obj, f'"{obj}"')


class HandlerStoreContract:
    """What every handler store does; subclasses provide ``stores``."""

    def test_a_shard_is_leased_to_one_claim_at_a_time(self, stores: Stores) -> None:
        store = stores(None)
        write(store, "a", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None and lease.shard == "a"
        assert stores(None).claim("u" * 32, LONG) is None

    def test_messages_are_read_in_order_and_a_success_deletes_one(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1", "2", "3")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        rows = store.read(lease, 10)
        assert [r.object_id for r in rows] == ["1", "2", "3"]
        with store.atomic():
            store.complete(lease, rows[0].id, LONG)
        assert [r.object_id for r in store.read(lease, 10)] == ["2", "3"]

    def test_an_emptied_shard_is_released_and_gone(self, stores: Stores) -> None:
        store = stores(None)
        write(store, "a", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        (row,) = store.read(lease, 10)
        with store.atomic():
            store.complete(lease, row.id, LONG)
        store.release(lease)
        write(store, "b", "1")
        again = store.claim("u" * 32, LONG)
        assert again is not None and again.shard == "b"

    def test_a_completion_that_raises_in_its_transaction_is_undone(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        (row,) = store.read(lease, 10)
        with pytest.raises(RuntimeError), store.atomic():
            store.complete(lease, row.id, LONG)
            raise RuntimeError("the receiver failed after all")
        assert [r.id for r in store.read(lease, 10)] == [row.id]

    def test_a_dead_processors_shard_is_taken_and_its_late_writes_fenced(
        self, stores: Stores
    ) -> None:
        dead, live = stores("d" * 32), stores("l" * 32)
        write(dead, "a", "1")
        dead.beat("d" * 32, "dead")
        lease = dead.claim("t" * 32, LONG)
        assert lease is not None
        (row,) = dead.read(lease, 10)
        time.sleep(0.3)
        live.beat("l" * 32, "live")
        assert live.take_over(0.2) == 1
        assert live.claim("u" * 32, LONG) is not None
        assert not dead.renew(lease, LONG)
        with pytest.raises(LeaseLost), dead.atomic():
            dead.complete(lease, row.id, LONG)

    def test_a_live_processor_is_not_taken_over(self, stores: Stores) -> None:
        store = stores("l" * 32)
        write(store, "a", "1")
        store.beat("l" * 32, "live")
        assert store.claim("t" * 32, LONG) is not None
        assert store.take_over(30.0) == 0
        store.leave("l" * 32)

    def test_a_failed_head_backs_its_shard_off_with_its_attempts(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        (row,) = store.read(lease, 10)
        store.retry_later(lease, row, 1, 0.3, "boom")
        assert store.claim("u" * 32, LONG) is None  # backing off
        time.sleep(0.6)
        again = store.claim("u" * 32, LONG)
        assert again is not None
        assert (again.attempts, again.head_id) == (1, row.id)

    def test_a_dead_letter_leaves_the_shard_and_expires(self, stores: Stores) -> None:
        store = stores(None)
        write(store, "a", "1", "2")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        first = store.read(lease, 10)[0]
        store.dead_letter(lease, first, 3, "poison", LONG)
        assert [r.object_id for r in store.read(lease, 10)] == ["2"]
        assert store.purge_dead_letters(3600.0) == 0
        time.sleep(1.2)
        assert store.purge_dead_letters(1.0) == 1

    def test_newest_finds_a_newer_message_of_an_object_beyond_the_rows_read(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1", "2", "1", "3", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        rows = store.read(lease, 2)
        newest = store.newest(lease, rows)
        assert newest[("c", "1")] == store.read(lease, 10)[-1].id
        assert ("c", "2") not in newest

    def test_a_requeued_shard_is_due_again_at_once(self, stores: Stores) -> None:
        store = stores(None)
        write(store, "a", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        store.requeue(lease)
        again = store.claim("u" * 32, LONG)
        assert again is not None and again.attempts == 0

    # -- what a run --until-empty leaves (#45) ------------------------------------

    def test_nothing_is_left_where_no_message_waits(self, stores: Stores) -> None:
        store = stores(None)
        assert store.leftover() == HandlerLeftover(store.using)

    def test_a_failing_shard_backing_off_is_left_with_its_last_error(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1", "2")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        store.retry_later(lease, store.read(lease, 10)[0], 1, LONG, "T\nKeyError: 1")
        assert store.leftover() == HandlerLeftover(
            store.using,
            failing=2,
            failing_shards=1,
            failing_shard="a",
            failing_error="T\nKeyError: 1",
        )

    def test_messages_only_a_pause_holds_are_held_naming_the_pauses(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1")
        write(store, "b", "1", "2", category="x")
        store.pause("shard", "a")
        store.pause("category", "x")
        store.pause("shard", "elsewhere")  # holds nothing: not named
        lease = store.claim("t" * 32, LONG)
        assert lease is not None and lease.shard == "b"
        store.hold(lease, "x", LONG)
        assert store.leftover() == HandlerLeftover(
            store.using, held=3, held_by_shards=("a",), held_by_categories=("x",)
        )

    def test_a_failing_shard_stays_failing_when_it_is_paused(
        self, stores: Stores
    ) -> None:
        store = stores(None)
        write(store, "a", "1")
        lease = store.claim("t" * 32, LONG)
        assert lease is not None
        store.retry_later(lease, store.read(lease, 10)[0], 1, LONG, "boom")
        store.pause("shard", "a")
        found = store.leftover()
        assert (found.failing, found.held, found.held_by_shards) == (1, 0, ())

    def test_a_held_shard_is_not_left_and_a_due_one_is_waiting(
        self, stores: Stores
    ) -> None:
        store, other = stores(None), stores("o" * 32)
        write(store, "a", "1", "2")
        assert other.claim("t" * 32, LONG) is not None  # another processor runs it
        assert store.leftover() == HandlerLeftover(store.using)
        write(store, "b", "1")  # written after the last look
        assert store.leftover() == HandlerLeftover(store.using, waiting=1)
