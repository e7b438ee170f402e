"""Publish-on-commit: the producing process publishes its own rows right after commit.

With ``CELERY_OUTBOX_PUBLISH_ON_COMMIT = True`` a transaction's rows are claimed
(with a lease, like the relay does), published and settled in a ``transaction.on_commit``
callback. Anything that goes wrong there is logged and left to the relay, which stays
the safety net: rows are already committed, so nothing can be lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction

from ..broker import build_publisher
from ..broker.base import queue_depth
from ..conf import get_settings
from ..flow.gate import gate_for
from ..store import Stores
from .config import RelayConfig
from .loop import Relay
from .observations import Observer
from .sent import sent_event_observers

logger = logging.getLogger("celery_outbox.oncommit")


@dataclass(frozen=True)
class _Pending:
    """The callback a thread's current transaction will run, and the ids it will publish."""

    alias: str
    task_ids: list[str]
    callback: Callable[[], None]


class CommitPublisher:
    """Publishes each committed transaction's rows from the process that wrote them."""

    def __init__(self, app: Any, observers: Iterable[Observer] = ()) -> None:
        """``observers`` hear each relay's observations (the app hands it Django's
        signals), before Celery's ``task-sent`` event when the app asks for it."""
        self._app = app
        self._observers = tuple(observers)
        # Publishers hold a broker connection: one per thread of a threaded server.
        self._local = threading.local()

    def schedule(self, alias: str, task_ids: Sequence[str]) -> None:
        """Publish these tasks' rows once the current transaction on ``alias`` commits.

        Several calls in one transaction share one callback (one claim, one batch),
        as long as that callback is still registered: a rolled-back savepoint or
        transaction drops it, and the next call registers a new one.
        """
        connection = connections[alias]
        if not connection.in_atomic_block:
            # Autocommit: the rows are committed already. A transaction managed by hand
            # (set_autocommit(False)) may still roll back, and on_commit() cannot
            # follow it: its rows are left to the relay.
            if connection.get_autocommit():
                self._flush(alias, list(task_ids))
            return
        pending: _Pending | None = getattr(self._local, "pending", None)
        if (
            pending is not None
            and pending.alias == alias
            and any(entry[1] is pending.callback for entry in connection.run_on_commit)
        ):
            pending.task_ids.extend(task_ids)
            return
        ids = list(task_ids)

        def callback() -> None:
            self._flush(alias, ids)

        self._local.pending = _Pending(alias, ids, callback)
        transaction.on_commit(callback, using=alias)

    def _flush(self, alias: str, task_ids: list[str]) -> None:
        pending: _Pending | None = getattr(self._local, "pending", None)
        if pending is not None and pending.task_ids is task_ids:
            self._local.pending = None
        try:
            relay = self._relay(alias)
            if not relay.settle_leftover():
                return  # the database still fails: leave the rows to the relay
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
        mine: _ThreadRelays | None = getattr(self._local, "relays", None)
        if mine is None or mine.pid != os.getpid():
            # A new thread, or a forked child: the broker connections of the parent
            # are not the child's to use (nor to close).
            mine = self._local.relays = _ThreadRelays()
        relays = mine.by_alias
        relay = relays.get(alias)
        if relay is None:
            settings = get_settings()
            # One outage is enough to stop trying from request threads for a while.
            config = RelayConfig.from_settings(settings, breaker_threshold=1)
            publisher = build_publisher(self._app, settings)
            stores = Stores(alias)
            relay = Relay(
                stores.relay(),
                publisher,
                config,
                observers=[*self._observers, *sent_event_observers(self._app)],
                # A flow's rate holds for the rows published at the commit too.
                gate=gate_for(settings, stores.flows(), queue_depth(publisher)),
            )
            relays[alias] = relay
        return relay


class _ThreadRelays:
    """One thread's relays by alias; their broker connections close when the thread ends.

    A server that runs each request on a new thread (or greenlet) would otherwise
    leave one broker connection behind per request.
    """

    def __init__(self) -> None:
        self.by_alias: dict[str, Relay] = {}
        self.pid = os.getpid()
        weakref.finalize(self, _close_relays, self.by_alias, self.pid)


def _close_relays(relays: dict[str, Relay], pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child dropping its parent's relays: their sockets are shared
    for relay in relays.values():
        with contextlib.suppress(Exception):
            relay.publisher.close()
        relay.waiter.close()
