"""The store contract against RelayQueries on every database alias, in real time."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from django.db import transaction

from celery_outbox.envelope import Envelope
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import Stores

from ..contract.store_contract import DeadView, StoreContract

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


class DatabaseHarness:
    """The relay's store on one alias; time is the database's, so waiting sleeps."""

    def __init__(self, alias: str, *, history: bool = False) -> None:
        self.alias = alias
        self.stores = Stores(alias, history=history)
        self.store = self.stores.relay()

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        with transaction.atomic(using=self.alias):
            self.stores.writer().insert(envelopes)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

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


@pytest.fixture
def harness(alias: str) -> DatabaseHarness:
    return DatabaseHarness(alias)


class TestRelayQueries(StoreContract):
    """Everything the relay relies on, on PostgreSQL, MariaDB and SQLite."""
