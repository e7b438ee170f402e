"""Where the outbox lives, and the one factory of the store's role objects on it.

A consumer resolves the outbox alias once (:func:`outbox_stores`) and takes the
role it needs: ``outbox_stores().operator().replay_dead_letters(...)``. Each role
object holds its alias and passes it as ``using=`` to every statement; none holds
another role's methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import router

from ..conf import OutboxSettings, get_settings
from .dedup import DedupKeys
from .events import EventRows
from .flows import FlowQueries
from .history import HistoryLog
from .operator import OperatorQueries
from .ordering import OrderingQueries
from .relays import RelayRegistry
from .store import OutboxWriter, RelayQueries


def outbox_alias(settings: OutboxSettings) -> str:
    """The database alias that holds the outbox tables."""
    if settings.database:
        return settings.database
    from ..models import OutboxMessage  # the app loads before Django's models

    return router.db_for_write(OutboxMessage)


def outbox_stores(
    settings: OutboxSettings | None = None, *, holder: str | None = None
) -> Stores:
    """The role objects on the outbox alias (``CELERY_OUTBOX_DATABASE`` or the router's).

    ``holder``: the heartbeat id of the relay they work for (see :class:`Stores`).
    """
    if settings is None:
        settings = get_settings()
    return Stores(outbox_alias(settings), holder=holder)


class Stores:
    """Builds the store's role objects on one database alias.

    ``holder`` is the heartbeat id of the relay the relay and registry roles work
    for (None: publish-on-commit, commands); ``history`` says whether settlements
    and operator moves write each message's history (None: ``CELERY_OUTBOX_HISTORY``,
    read here, once).
    """

    __slots__ = ("alias", "history", "holder")

    def __init__(
        self, alias: str, *, holder: str | None = None, history: bool | None = None
    ) -> None:
        self.alias = alias
        self.holder = holder
        self.history = get_settings().history if history is None else history

    def relay(self) -> RelayQueries:
        """What a relay claims and settles."""
        return RelayQueries(self.alias, holder=self.holder, history=self.history)

    def writer(self) -> OutboxWriter:
        """What the enqueue path writes."""
        return OutboxWriter(self.alias)

    def dedup(self) -> DedupKeys:
        """``dedup_key`` holds."""
        return DedupKeys(self.alias)

    def operator(self) -> OperatorQueries:
        """Statistics, retry now, and the dead letters' moves, replays and purges."""
        return OperatorQueries(self.alias, history=self.history)

    def ordering(self) -> OrderingQueries:
        """Ordered keys' heads: strict tasks' reports, blocked heads, statistics."""
        return OrderingQueries(self.alias)

    def history_log(self) -> HistoryLog:
        """Each message's history, where it is now, and the history's retention."""
        return HistoryLog(self.alias, history=self.history)

    def registry(self) -> RelayRegistry:
        """Relay heartbeats (``holder``'s, and the takeover of silent relays)."""
        return RelayRegistry(self.alias, holder=self.holder)

    def events(self) -> EventRows:
        """Event retries the database holds, and the services' dead events."""
        return EventRows(self.alias)

    def flows(self) -> FlowQueries:
        """Flow control's rows: the gate's reservations, the operator's rates."""
        return FlowQueries(self.alias)


if TYPE_CHECKING:  # mypy checks here that each object implements its role
    from .protocol import (
        DedupStore,
        EnqueueStore,
        EventStore,
        FlowStore,
        HistoryStore,
        OperatorStore,
        OrderingStore,
        RegistryStore,
        RelayStore,
    )

    _relay: type[RelayStore] = RelayQueries
    _writer: type[EnqueueStore] = OutboxWriter
    _dedup: type[DedupStore] = DedupKeys
    _operator: type[OperatorStore] = OperatorQueries
    _ordering: type[OrderingStore] = OrderingQueries
    _history: type[HistoryStore] = HistoryLog
    _registry: type[RegistryStore] = RelayRegistry
    _events: type[EventStore] = EventRows
    _flows: type[FlowStore] = FlowQueries
