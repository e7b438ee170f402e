"""Flow control's store on every database alias, in real time (about 5 s per alias)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from django.db import transaction

from celery_outbox.envelope import Envelope, StoredMessage
from celery_outbox.store import FlowStore, Stores

from ..contract.flow_contract import FlowContract

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


class DatabaseFlows:
    """The flow store on one alias; time is the database's, so waiting sleeps."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.flows = Stores(alias).flows()

    def store_for_thread(self) -> FlowStore:
        # Its reset_connection closes the thread's own connection.
        return Stores(self.alias).flows()

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        with transaction.atomic(using=self.alias):
            Stores(self.alias).writer().insert(envelopes)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def claim(self, limit: int) -> tuple[str, Sequence[StoredMessage]]:
        found = Stores(self.alias).relay().claim(limit, 30.0)
        return found.token, found.messages


@pytest.fixture
def flows(alias: str) -> DatabaseFlows:
    return DatabaseFlows(alias)


class TestFlowQueries(FlowContract):
    """What flow control relies on, on PostgreSQL, MariaDB and SQLite."""
