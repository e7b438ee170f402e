"""The relay's heartbeat: a thread that says "alive" and takes over dead relays' rows.

It runs beside the loop on a database connection of its own, so a batch that waits
out its whole send timeout still beats on time: a slow relay is never taken for a
dead one. Each beat also ends the leases of relays silent for
:data:`STALE_BEATS` intervals (see :mod:`celery_outbox.store.relays`), and wakes
the loop to claim those rows at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

from ..exceptions import OutboxDatabaseError
from ..store import RegistryStore

logger = logging.getLogger("celery_outbox.relay")

#: A relay silent for this many heartbeat intervals is taken for dead.
STALE_BEATS = 3


def new_relay_id() -> str:
    """A fresh heartbeat id (it fits the ``holder`` column)."""
    return uuid.uuid4().hex


class Heartbeat:
    """Beats for ``store.holder`` every ``interval`` seconds while the relay runs."""

    def __init__(
        self,
        store: RegistryStore,
        interval: float,
        *,
        on_takeover: Callable[[], None] = lambda: None,
    ) -> None:
        if store.holder is None:
            raise ValueError("a heartbeat needs a store that claims for a holder")
        self.store = store
        self.relay_id = store.holder
        self.interval = interval
        self.on_takeover = on_takeover
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stale_seconds(self) -> float:
        """How long a relay may stay silent before others take its rows."""
        return STALE_BEATS * self.interval

    def start(self) -> None:
        """Beat once now (before the first claim), then from a daemon thread."""
        self.beat()
        self._thread = threading.Thread(
            target=self._run, name="outbox-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and remove this relay's heartbeat row."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.store.leave(self.relay_id)
        except OutboxDatabaseError as exc:
            # The row goes stale and the next relay's heartbeat removes it.
            logger.warning("cannot remove the relay heartbeat: %s", exc)

    def beat(self) -> int:
        """Write the heartbeat, then take over stale relays; rows taken over."""
        try:
            self.store.beat(self.relay_id, self.name)
            taken = self.store.take_over(self.stale_seconds)
        except OutboxDatabaseError as exc:
            logger.warning("relay heartbeat failed: %s", exc)
            self.store.reset_connection()
            return 0
        if taken:
            logger.warning(
                "took over %d leased rows of relays silent for over %.1f s",
                taken,
                self.stale_seconds,
            )
            self.on_takeover()
        return taken

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.beat()
        finally:
            self.store.reset_connection()  # this thread's connection
