"""The lease keeper: renews a lease from a thread while a long piece of work runs.

Every write made under a lease is fenced by its token (the store's UPDATE matches
only while the token is still there), so a member whose lease was taken over
changes nothing; the keeper only makes that rare, by renewing every third of the
lease. A renewal that finds the lease gone stops and says so (:attr:`lost`); one
that meets a database error tries again at the next third.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from ..exceptions import OutboxDatabaseError

logger = logging.getLogger("celery_outbox.engine")


class LeaseKeeper:
    """A context manager: renews with ``renew()`` every ``lease_seconds / 3``.

    ``renew`` returns False once the lease is no longer ours. ``done`` runs on the
    keeper's thread as it ends (to close that thread's database connection).
    """

    def __init__(
        self,
        renew: Callable[[], bool],
        lease_seconds: float,
        *,
        name: str = "lease",
        done: Callable[[], None] = lambda: None,
        log: logging.Logger = logger,
    ) -> None:
        self._renew = renew
        self._seconds = lease_seconds
        self._done = done
        self._log = log
        self.name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"outbox-{name}", daemon=True
        )
        #: Set when a renewal found the lease gone.
        self.lost = False

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=self._seconds)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._seconds / 3):
                try:
                    renewed = self._renew()
                except OutboxDatabaseError as exc:
                    self._log.warning("renewing the %s failed: %s", self.name, exc)
                    continue
                if not renewed:
                    self.lost = True
                    self._log.warning("%s lost", self.name)
                    return
        finally:
            self._done()
