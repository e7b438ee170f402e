"""The heartbeat: a thread that says "alive" and takes over dead members' work.

A member is one running process of a lane (a relay, a handler processor). Its
heartbeat runs beside the loop on a database connection of its own, so a turn
that waits out its whole send timeout still beats on time: a slow member is never
taken for a dead one. Each beat also ends the leases of members silent for
:data:`STALE_BEATS` intervals, and calls ``on_takeover`` (the loop's wake-up) so
that their work is claimed at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

from ..exceptions import OutboxDatabaseError
from ..store.protocol import Membership

#: A member silent for this many heartbeat intervals is taken for dead.
STALE_BEATS = 3


def new_member_id() -> str:
    """A fresh member id (32 hex characters: it fits the ``holder`` columns)."""
    return uuid.uuid4().hex


class Heartbeat:
    """Beats for ``store.holder`` every ``interval`` seconds while the loop runs."""

    def __init__(
        self,
        store: Membership,
        interval: float,
        *,
        on_takeover: Callable[[], None] = lambda: None,
        what: str = "relay",
        log: logging.Logger | None = None,
    ) -> None:
        if store.holder is None:
            raise ValueError("a heartbeat needs a store that claims for a holder")
        self.store = store
        self.member_id = store.holder
        self.interval = interval
        self.on_takeover = on_takeover
        #: What a member is, in log lines ("relay", "handler processor").
        self.what = what
        self.log = log or logging.getLogger("celery_outbox.relay")
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def relay_id(self) -> str:
        """The member id (the relay's name for it)."""
        return self.member_id

    @property
    def stale_seconds(self) -> float:
        """How long a member may stay silent before others take its work."""
        return STALE_BEATS * self.interval

    def start(self) -> None:
        """Beat once now (before the first claim), then from a daemon thread."""
        self.beat()
        self._thread = threading.Thread(
            target=self._run, name="outbox-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and remove this member's heartbeat row."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.store.leave(self.member_id)
        except OutboxDatabaseError as exc:
            # The row goes stale and the next member's heartbeat removes it.
            self.log.warning("cannot remove the %s heartbeat: %s", self.what, exc)

    def beat(self) -> int:
        """Write the heartbeat, then take over stale members; leases ended."""
        try:
            self.store.beat(self.member_id, self.name)
            taken = self.store.take_over(self.stale_seconds)
        except OutboxDatabaseError as exc:
            self.log.warning("%s heartbeat failed: %s", self.what, exc)
            self.store.reset_connection()
            return 0
        if taken:
            self.log.warning(
                "took over %d lease(s) of %ss silent for over %.1f s",
                taken,
                self.what,
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
