"""The handler store's contract on the in-memory twin (no database)."""

from __future__ import annotations

import pytest

from celery_outbox.store.handlers import HandlerTables, MemoryHandlerStore

from ..contract.handler_contract import HandlerStoreContract, Stores


class TestMemoryHandlerStore(HandlerStoreContract):
    @pytest.fixture
    def stores(self) -> Stores:
        tables = HandlerTables()
        return lambda holder: MemoryHandlerStore(tables, holder=holder)
