"""What the handler processor asks of a store: the leased-work role of the handler lane.

:class:`~.sql.HandlerStore` implements it on a database alias,
:class:`~.memory.MemoryHandlerStore` in memory (the processor's unit tests run on it).
``tests/contract/handler_contract.py`` holds both to the same behaviour.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from .types import HandlerLeftover, Lease, Pauses, Row


class HandlerLeases(Protocol):
    """Shards claimed under a lease, their messages run and settled by token."""

    using: str
    holder: str | None

    def write(self, category: str, shard: str, object_id: str, payload: str) -> None:
        """Add a message at the end of its shard (in the caller's transaction)."""
        ...

    def ensure_shards(self, shards: Iterable[str]) -> None:
        """Create the shard rows that do not exist."""
        ...

    def discover(self, limit: int = ...) -> int:
        """Recreate missing shard rows of waiting messages; how many."""
        ...

    def claim(
        self, token: str, lease_seconds: float, shards: Sequence[str] | None = None
    ) -> Lease | None:
        """Lease the oldest due shard that is neither leased nor paused."""
        ...

    def read(self, lease: Lease, limit: int) -> list[Row]:
        """The shard's first ``limit`` messages, in id order."""
        ...

    def newest(self, lease: Lease, rows: Sequence[Row]) -> dict[tuple[str, str], int]:
        """The newest id of each (category, object id) of ``rows`` after them in the shard."""
        ...

    def atomic(self) -> AbstractContextManager[Any]:
        """A transaction on the store (a receiver runs in it when atomic)."""
        ...

    def complete(self, lease: Lease, message_id: int, lease_seconds: float) -> None:
        """Delete a message whose receiver succeeded; fenced by the lease."""
        ...

    def discard(
        self,
        lease: Lease,
        ids: Sequence[int],
        counts: dict[str, int],
        lease_seconds: float,
    ) -> None:
        """Delete superseded messages and count them; fenced."""
        ...

    def retry_later(
        self, lease: Lease, row: Row, attempts: int, delay: float, error: str
    ) -> None:
        """Back the shard off after its head failed, giving the lease up."""
        ...

    def dead_letter(
        self, lease: Lease, row: Row, attempts: int, error: str, lease_seconds: float
    ) -> None:
        """Move the head to the dead letters; fenced."""
        ...

    def hold(self, lease: Lease, category: str, recheck_seconds: float) -> None:
        """Stop at a head whose category is paused."""
        ...

    def release(self, lease: Lease) -> None:
        """Give the shard up (deleting it when empty)."""
        ...

    def requeue(self, lease: Lease) -> None:
        """Give the lease up with the shard due now."""
        ...

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend the lease; False once it is no longer ours."""
        ...

    def pauses(self) -> Pauses:
        """The categories and shards paused."""
        ...

    def leftover(self) -> HandlerLeftover:
        """The messages no processor holds, by what they wait for (a run's end)."""
        ...

    def beat(self, relay_id: str, name: str) -> None:
        """Record that processor ``relay_id`` is alive now."""
        ...

    def take_over(self, stale_seconds: float) -> int:
        """End the leases of processors silent for ``stale_seconds``; how many."""
        ...

    def leave(self, relay_id: str) -> None:
        """Remove processor ``relay_id``'s heartbeat."""
        ...

    def purge_dead_letters(self, older_than: float, chunk: int = ...) -> int:
        """Delete dead letters older than ``older_than`` seconds; how many."""
        ...

    def reset_connection(self) -> None:
        """Drop this thread's connection (the next call reconnects)."""
        ...
