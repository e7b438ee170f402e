"""The handler store's contract on every database (PostgreSQL, MariaDB, SQLite)."""

from __future__ import annotations

import pytest

from celery_outbox.store.handlers.sql import HandlerStore

from ..contract.handler_contract import HandlerStoreContract, Stores

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


class TestHandlerStore(HandlerStoreContract):
    @pytest.fixture
    def stores(self, alias: str) -> Stores:
        return lambda holder: HandlerStore(alias, holder=holder)
