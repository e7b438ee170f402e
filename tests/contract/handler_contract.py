"""The contract of the handler store (:class:`celery_outbox.store.handlers.HandlerLeases`).

``tests/unit/test_handler_store_memory.py`` runs it on the in-memory twin,
``tests/integration/test_handler_store_contract.py`` on every database. A suite
subclass gives the ``stores`` fixture: ``stores(holder)`` is a store of one shared
database for the processor ``holder``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from celery_outbox.store.handlers import HandlerLeases, LeaseLost

Stores = Callable[[str | None], HandlerLeases]
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
