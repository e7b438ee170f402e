"""``OutboxStore``, every role of the store in one object: kept for one release.

Build the role you need instead: ``outbox_stores().ordering().blocked_heads()``
(see :class:`~.roles.Stores`).
"""

from __future__ import annotations

from ..deprecation import deprecated
from .dedup import DedupKeys
from .history import HistoryLog
from .operator import OperatorQueries
from .ordering import OrderingQueries
from .relays import RelayRegistry
from .store import OutboxWriter, RelayQueries


class OutboxStore(
    RelayQueries,
    OutboxWriter,
    DedupKeys,
    RelayRegistry,
    OperatorQueries,
    OrderingQueries,
    HistoryLog,
):
    """Deprecated: every role of the store on one alias; goes in 1.0."""

    def __init__(
        self, alias: str, *, holder: str | None = None, history: bool | None = None
    ) -> None:
        deprecated(
            "celery_outbox.store.OutboxStore",
            "the role you need from celery_outbox.store.outbox_stores() (or "
            "Stores(alias))",
            note=".ordering() for blocked heads, .operator() for statistics and dead "
            "letters, .history_log() for a message's trace.",
        )
        super().__init__(alias, holder=holder, history=history)
