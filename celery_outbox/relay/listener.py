"""The relay's LISTEN connection: woken at once when rows with the hint commit.

The hint itself is written by the store (:mod:`celery_outbox.store.notify`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

from django.db import connections

from ..store.notify import CHANNEL

logger = logging.getLogger("celery_outbox.relay")


class PgNotifyListener:
    """A dedicated LISTEN connection whose socket the relay's waiter selects on."""

    def __init__(self, alias: str, probe_timeout: float = 2.0) -> None:
        self.alias = alias
        self.probe_timeout = probe_timeout
        self._conn: Any = None
        self._retry_at = 0.0
        self._disabled_reason: str | None = None

    @property
    def active(self) -> bool:
        """Whether notifications are being received now."""
        return self._conn is not None

    def fileno(self) -> int | None:
        """The socket to select on, opening the connection if it is time to try."""
        if (
            self._conn is None
            and self._disabled_reason is None
            and time.monotonic() >= self._retry_at
        ):
            self._open()
        return None if self._conn is None else int(self._conn.fileno())

    def drain(self) -> int:
        """Consume pending notifications; returns how many arrived."""
        if self._conn is None:
            return 0
        try:
            return sum(1 for _ in self._conn.notifies(timeout=0))
        except Exception as exc:
            self._lost(exc)
            return 0

    def close(self) -> None:
        """Close the LISTEN connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _open(self) -> None:
        wrapper = connections[self.alias]
        try:
            conn = wrapper.get_new_connection(wrapper.get_connection_params())
            conn.autocommit = True
            conn.execute(f"LISTEN {CHANNEL}")
            if not self._probe(conn):
                self._disabled_reason = "probe notification never arrived"
                logger.warning(
                    "LISTEN/NOTIFY does not reach the relay through database %r (a pooler "
                    "in transaction mode, such as PgBouncer, drops notifications); the "
                    "relay polls instead. Set CELERY_OUTBOX_NOTIFY = False to skip the hint.",
                    self.alias,
                )
                conn.close()
                return
        except Exception as exc:
            self._lost(exc)
            return
        self._conn = conn
        logger.info("listening for new outbox rows on %r", self.alias)

    def _probe(self, conn: Any) -> bool:
        payload = f"probe-{uuid.uuid4().hex}"
        wrapper = connections[self.alias]
        sender = wrapper.get_new_connection(wrapper.get_connection_params())
        try:
            sender.autocommit = True
            sender.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])
        finally:
            sender.close()
        deadline = time.monotonic() + self.probe_timeout
        while time.monotonic() < deadline:
            for note in conn.notifies(timeout=max(deadline - time.monotonic(), 0.0)):
                if note.payload == payload:
                    return True
        return False

    def _lost(self, exc: BaseException) -> None:
        self.close()
        self._retry_at = time.monotonic() + 5.0
        logger.warning(
            "LISTEN connection lost (%s: %s); polling until it is back",
            type(exc).__name__,
            exc,
        )
