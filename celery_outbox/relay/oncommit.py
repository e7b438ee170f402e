"""Publish-on-commit: the producing process publishes its own rows right after commit.

With ``CELERY_OUTBOX_PUBLISH_ON_COMMIT = True`` a transaction's rows are claimed
(with a lease, like the relay does), published and settled in a ``transaction.on_commit``
callback. Anything that goes wrong there is logged and left to the relay, which stays
the safety net: rows are already committed, so nothing can be lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from django.db import connections, transaction

from ..broker import build_publisher
from ..conf import get_settings
from ..store import OutboxStore
from .config import RelayConfig
from .loop import Relay

logger = logging.getLogger("celery_outbox.oncommit")


class CommitPublisher:
    """Publishes each committed transaction's rows from the process that wrote them."""

    def __init__(self, app: Any) -> None:
        self._app = app
        # Publishers hold a broker connection: one per thread of a threaded server.
        self._local = threading.local()

    def schedule(self, alias: str, task_ids: Sequence[str]) -> None:
        """Publish these tasks' rows once the current transaction on ``alias`` commits.

        Several calls in one transaction share one callback (one claim, one batch).
        """
        connection = connections[alias]
        if not connection.in_atomic_block:
            self._flush(alias, list(task_ids))
            return
        outermost = connection.atomic_blocks[0]
        pending = getattr(self._local, "pending", None)
        if pending is not None and pending[0] is outermost and pending[1] == alias:
            pending[2].extend(task_ids)
            return
        ids = list(task_ids)
        self._local.pending = (outermost, alias, ids)
        transaction.on_commit(lambda: self._flush(alias, ids), using=alias)

    def _flush(self, alias: str, task_ids: list[str]) -> None:
        self._local.pending = None
        try:
            relay = self._relay(alias)
            if relay.breaker.is_open(relay.clock()):
                return  # the broker was just down: leave the rows to the relay
            claim = relay.store.claim(
                len(task_ids), relay.config.lease_seconds, task_ids=task_ids
            )
            relay.process(claim)
        except Exception:
            logger.exception(
                "publish-on-commit failed; the relay will publish these rows"
            )

    def _relay(self, alias: str) -> Relay:
        relays: dict[str, Relay] = self._local.__dict__.setdefault("relays", {})
        relay = relays.get(alias)
        if relay is None:
            from ..signals import send_relay_signals

            settings = get_settings()
            # One outage is enough to stop trying from request threads for a while.
            config = RelayConfig.from_settings(settings, breaker_threshold=1)
            publisher = build_publisher(self._app, settings)
            relay = Relay(
                OutboxStore(alias), publisher, config, listeners=[send_relay_signals]
            )
            relays[alias] = relay
        return relay
