"""What the relay needs of a store: the one seam between the loop and its database.

:class:`~celery_outbox.store.OutboxStore` implements it on a Django database alias;
:class:`~celery_outbox.store.memory.InMemoryStore` implements it in memory, for tests
that drive the real relay loop without a database.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from ..outcomes import Settlement
from .types import Claim, SettleReport


class RelayStore(Protocol):
    """Claims due rows under a lease and settles them, fenced by the lease token.

    A row is due once its ``available_at`` has passed. Claiming leases it: it stays
    out of every other claim for ``lease_seconds`` and carries the claim's token.
    Every later write for the row (settle, renew) names that token and changes
    nothing once another claim has taken the row: a relay that lost its lease can
    never delete, retry or dead-letter what another relay now holds.
    """

    @property
    def alias(self) -> str:
        """The name of the database the rows live in (for logs)."""
        ...

    @property
    def concurrent_claims(self) -> bool:
        """Whether several claims may run at once (another thread, another relay)."""
        ...

    def relay_lock(self) -> AbstractContextManager[None]:
        """Held while a relay runs; refuses a second relay where only one may claim."""
        ...

    def claim(
        self, limit: int, lease_seconds: float, *, task_ids: Sequence[str] = ()
    ) -> Claim:
        """Lease up to ``limit`` due rows, oldest due first, to a new token.

        Rows held by a live lease are skipped; ``task_ids`` restricts the claim to
        those tasks' rows.
        """
        ...

    def settle(self, token: str, settlement: Settlement) -> SettleReport:
        """Delete, retry, release and dead-letter rows still held under ``token``.

        A retry uses an attempt and records the error; a release uses none. Both make
        the row due again after the decision's delay. The report counts the rows each
        part changed; fewer than asked means the lease on the others was lost.
        """
        ...

    def seconds_until_due(self) -> float | None:
        """Seconds until the next row not yet due falls due (a scheduled task, a
        retry, a lease's end); None when no row waits."""
        ...

    def renew(self, token: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease on those of ``ids`` still held under ``token``; how many."""
        ...

    def reset_connection(self) -> None:
        """Drop a connection that failed, so that the next call reconnects."""
        ...
