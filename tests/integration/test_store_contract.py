"""The store's contracts on every database alias, in real time: the relay's, the
enqueue's and the operator's (also run on the in-memory twins), and those of the roles
only a database implements."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone

import pytest
from django.db import transaction

from celery_outbox.envelope import Envelope
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import RegistryStore, RelayStore, Stores

from ..contract.operator_contract import OperatorContract
from ..contract.role_contracts import (
    HOLDER,
    DedupContract,
    EventContract,
    HistoryContract,
    OrderingContract,
    RegistryContract,
)
from ..contract.store_contract import DeadView, EnqueueContract, StoreContract

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


class DatabaseHarness:
    """The store's roles on one alias; time is the database's, so waiting sleeps."""

    def __init__(self, alias: str, *, history: bool = False) -> None:
        self.alias = alias
        self.stores = Stores(alias, holder=HOLDER, history=history)
        self.store = self.stores.relay()
        self.relay = self.store
        self.writer = self.stores.writer()
        self.operator = self.stores.operator()
        self.ordering = self.stores.ordering()
        self.history = self.stores.history_log()
        self.dedup = self.stores.dedup()
        self.events = self.stores.events()

    def registry(self, holder: str) -> RegistryStore:
        return Stores(self.alias, holder=holder).registry()

    def relay_for(self, holder: str) -> RelayStore:
        return Stores(self.alias, holder=holder).relay()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with transaction.atomic(using=self.alias):
            yield

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        with transaction.atomic(using=self.alias):
            self.writer.insert(envelopes)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def now(self) -> datetime:
        # The database runs on this host: its clock is this one.
        return datetime.now(timezone.utc)

    def pending(self) -> int:
        return int(OutboxMessage.objects.using(self.alias).count())

    def state(self, row_id: int) -> tuple[int, str]:
        row = OutboxMessage.objects.using(self.alias).get(id=row_id)
        return row.attempts, row.last_error

    def dead_letters(self) -> list[DeadView]:
        return [
            DeadView(d.original_id, d.task_id, bytes(d.body), d.attempts, d.last_error)
            for d in DeadLetter.objects.using(self.alias).order_by("id")
        ]

    def dead_ids(self) -> list[int]:
        return list(
            DeadLetter.objects.using(self.alias)
            .order_by("id")
            .values_list("id", flat=True)
        )

    def dead_task_ids(self) -> list[str]:
        return list(
            DeadLetter.objects.using(self.alias)
            .order_by("id")
            .values_list("task_id", flat=True)
        )


@pytest.fixture
def harness(alias: str) -> DatabaseHarness:
    return DatabaseHarness(alias)


@pytest.fixture
def roles(alias: str) -> DatabaseHarness:
    return DatabaseHarness(alias, history=True)


class TestRelayQueries(StoreContract):
    """Everything the relay relies on, on PostgreSQL, MariaDB and SQLite."""


class TestOutboxWriter(EnqueueContract):
    """What the enqueue path's writer promises, on every database."""


class TestOperatorQueries(OperatorContract):
    """What operators rely on, on every database."""


class TestOrderingQueries(OrderingContract):
    """Ordered keys' heads, on every database."""


class TestHistoryLog(HistoryContract):
    """Each message's history, on every database."""


class TestRelayRegistry(RegistryContract):
    """Relay heartbeats and takeover, on every database."""


class TestDedupKeys(DedupContract):
    """``dedup_key`` holds, on every database."""


class TestEventRows(EventContract):
    """Event retries and archives, on every database."""
