"""The store contract with history on: writing it changes nothing the relay relies on."""

from __future__ import annotations

import pytest

from ..contract.store_contract import StoreContract
from .test_store_contract import DatabaseHarness

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


class HistoryHarness(DatabaseHarness):
    """The database harness, its store writing each message's history."""

    def __init__(self, alias: str) -> None:
        super().__init__(alias, history=True)


@pytest.fixture
def harness(alias: str) -> HistoryHarness:
    return HistoryHarness(alias)


class TestRelayQueriesWithHistory(StoreContract):
    """Everything the relay relies on, with history on, on every database."""
