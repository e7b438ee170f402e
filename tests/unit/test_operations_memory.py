"""``outbox tasks stats``, ``replay`` and ``purge`` on the in-memory twins, after the real
relay loop dead-lettered what the broker refused: no database, no broker, no sleeping.
"""

from __future__ import annotations

import io
import json

from django.core.management.base import OutputWrapper

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.envelope import StoredMessage
from celery_outbox.operations import (
    PurgeRequest,
    ReplayRequest,
    StatsRequest,
    purge,
    render_stats,
    replay,
)
from celery_outbox.outcomes import Outcome, PublishResult
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.core import RetryPolicy
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import StopReason
from celery_outbox.store.memory import InMemoryStore
from celery_outbox.store.memory_operator import InMemoryOperatorQueries

from ..integration.builders import envelope
from .fakes import FakeClock, FakeWaiter

REFUSED = "PreconditionFailed: body too large"


class Outbox:
    """An in-memory outbox, a relay draining it, and the operator's queries on it."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = InMemoryStore(self.clock)
        self.operator = InMemoryOperatorQueries(self.store.tables)
        self.refusing = True

    def drain(self) -> list[str]:
        """Run a relay until the outbox is empty (refused rows dead-lettered); the
        task ids it published."""
        publisher = InMemoryPublisher(self._broker)
        config = RelayConfig(
            batch_size=10,
            lease_seconds=30.0,
            poll_interval=1.0,
            send_timeout=10.0,
            policy=RetryPolicy(
                2, base_seconds=1.0, max_seconds=1.0, outage_cooldown=5.0
            ),
            until_empty=True,
        )
        relay = Relay(
            self.store,
            publisher,
            config,
            clock=self.clock,
            waiter=FakeWaiter(self.clock),
            observers=(),
        )
        for _ in range(10):  # refused rows come back after their backoff
            # A run that leaves a refused row waiting for its retry says so.
            assert relay.run() in (StopReason.EMPTY, StopReason.UNFINISHED)
            if not self.store.pending():
                return [e.task_id for e in publisher.published]
            self.clock.advance(2.0)
        raise AssertionError(f"rows left in the outbox: {self.store.rows}")

    def _broker(self, message: StoredMessage) -> PublishResult | None:
        if self.refusing and message.envelope.task_id.startswith("poison"):
            return PublishResult(message.id, Outcome.FAILED, REFUSED)
        return None


def stats(outbox: Outbox) -> dict[str, object]:
    rendered = render_stats(outbox.operator, StatsRequest(format="json", top=3))
    loaded: dict[str, object] = json.loads(rendered)
    return loaded


def test_a_dead_letter_is_counted_replayed_and_published_after_the_fix() -> None:
    outbox = Outbox()
    poison, fine = envelope("poison"), envelope("fine")
    outbox.store.insert([poison, fine])
    assert outbox.drain() == [fine.task_id]
    assert stats(outbox)["dead"] == 1
    assert stats(outbox)["top_failures"] == {
        "retrying": [],
        "dead": [{"task_name": "shop.record", "dead": 1}],
    }

    outbox.refusing = False  # the queue was fixed
    request = ReplayRequest.parse(
        ids=[],
        task="shop.*",
        since=None,
        until=None,
        everything=False,
        dry_run=False,
        chunk_size=500,
    )
    said = replay(outbox.operator, request, OutputWrapper(io.StringIO()))

    assert said == "replayed 1 dead letter(s) into the outbox: shop.record 1"
    assert outbox.drain() == [poison.task_id]
    assert (stats(outbox)["pending"], stats(outbox)["dead"]) == (0, 0)


def test_a_purge_deletes_only_dead_letters_older_than_asked() -> None:
    outbox = Outbox()
    outbox.store.insert([envelope("poison-old")])
    outbox.drain()
    outbox.clock.advance(2 * 3600)
    outbox.store.insert([envelope("poison-new")])
    outbox.drain()

    def run(dry_run: bool) -> str:
        request = PurgeRequest(3600.0, dry_run=dry_run, chunk_size=1000)
        return purge(outbox.operator, request)

    assert run(dry_run=True) == "would delete 1 dead letter(s) older than 1h (dry run)"
    assert run(dry_run=False) == "deleted 1 dead letter(s) older than 1h"
    assert [d.envelope.task_id[:10] for d in outbox.store.dead] == ["poison-new"]
