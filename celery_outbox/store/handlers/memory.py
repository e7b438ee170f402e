"""The handler store in memory: the twin the processor's unit tests run on.

It keeps the SQL store's behaviour (``tests/contract/handler_contract.py`` runs on
both): leases and their tokens, fencing (:class:`~.types.LeaseLost`), backoff,
pauses, dead letters, heartbeats and takeover. Several stores over one
:class:`HandlerTables` are several processors on one database. Times are the
injected clock's seconds.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ...text import storable
from .types import ERROR_LIMIT, HandlerLeftover, Lease, LeaseLost, Pauses, Row


@dataclass
class _Message:
    id: int
    category: str
    shard: str
    object_id: str
    payload: str
    created_at: datetime
    written_at: float


@dataclass
class _Shard:
    pk: int
    shard: str
    next_attempt_at: float
    lease_token: str | None = None
    leased_until: float | None = None
    holder: str | None = None
    attempts: int = 0
    head_id: int | None = None
    last_error: str = ""
    failing_since: float | None = None
    held_by: str = ""


@dataclass
class DeadLetter:
    """A handler dead letter in memory."""

    message_id: int
    category: str
    shard: str
    object_id: str
    payload: str
    attempts: int
    last_error: str
    died_at: float


@dataclass
class HandlerTables:
    """What one database would hold: messages, shards, dead letters, pauses, beats."""

    messages: dict[int, _Message] = field(default_factory=dict)
    shards: dict[str, _Shard] = field(default_factory=dict)
    dead: list[DeadLetter] = field(default_factory=list)
    paused_categories: set[str] = field(default_factory=set)
    paused_shards: set[str] = field(default_factory=set)
    processors: dict[str, float] = field(default_factory=dict)
    coalesced: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    next_id: int = 1
    #: Held by every call: a store's lease keeper renews from a thread of its own.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)


class MemoryHandlerStore:
    """:class:`~.protocol.HandlerLeases` over :class:`HandlerTables`."""

    def __init__(
        self,
        tables: HandlerTables | None = None,
        *,
        using: str = "memory",
        holder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tables = tables if tables is not None else HandlerTables()
        self.using = using
        self.holder = holder
        self.clock = clock
        self._lock = self.tables.lock

    def sibling(self, holder: str | None) -> MemoryHandlerStore:
        """Another store on the same tables (another processor on the database)."""
        return MemoryHandlerStore(
            self.tables, using=self.using, holder=holder, clock=self.clock
        )

    # -- writing ----------------------------------------------------------------

    def write(self, category: str, shard: str, object_id: str, payload: str) -> None:
        """Add a message at the end of its shard, and its shard when new."""
        with self._lock:
            t = self.tables
            t.messages[t.next_id] = _Message(
                t.next_id,
                category,
                shard,
                object_id,
                payload,
                datetime.now(timezone.utc),
                self.clock(),
            )
            t.next_id += 1
            self.ensure_shards([shard])

    def ensure_shards(self, shards: Iterable[str]) -> None:
        """Create the shards that do not exist."""
        with self._lock:
            for key in sorted(set(shards)):
                if key not in self.tables.shards:
                    self.tables.shards[key] = _Shard(
                        self.tables.next_id, key, self.clock()
                    )
                    self.tables.next_id += 1

    def discover(self, limit: int = 1000) -> int:
        """Recreate the shards of messages that have none; how many."""
        with self._lock:
            missing = sorted(
                {m.shard for m in self.tables.messages.values()}
                - set(self.tables.shards)
            )[:limit]
            self.ensure_shards(missing)
            return len(missing)

    # -- leases -----------------------------------------------------------------

    def claim(
        self, token: str, lease_seconds: float, shards: Sequence[str] | None = None
    ) -> Lease | None:
        """Lease the oldest due shard that is neither leased nor paused."""
        with self._lock:
            now = self.clock()
            due = [
                s
                for s in self.tables.shards.values()
                if self._free(s, now)
                and s.next_attempt_at <= now
                and s.shard not in self.tables.paused_shards
                and (shards is None or s.shard in shards)
            ]
            if not due:
                return None
            s = min(due, key=lambda s: (s.next_attempt_at, s.pk))
            s.lease_token, s.leased_until, s.holder = (
                token,
                now + lease_seconds,
                self.holder,
            )
            return Lease(s.pk, s.shard, token, s.attempts, s.head_id)

    def read(self, lease: Lease, limit: int) -> list[Row]:
        """The shard's first ``limit`` messages, in id order."""
        with self._lock:
            now = self.clock()
            return [
                Row(
                    m.id,
                    m.category,
                    m.object_id,
                    m.payload,
                    m.created_at,
                    now - m.written_at,
                )
                for m in self._in(lease.shard)[:limit]
            ]

    def newest(self, lease: Lease, rows: Sequence[Row]) -> dict[tuple[str, str], int]:
        """The newest id of each (category, object id) of ``rows`` after them."""
        if not rows:
            return {}
        keys = {(r.category, r.object_id) for r in rows}
        newest: dict[tuple[str, str], int] = {}
        with self._lock:
            for m in self._in(lease.shard):
                key = (m.category, m.object_id)
                if m.id > rows[-1].id and key in keys:
                    newest[key] = m.id
        return newest

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """All or nothing: what the block changed is undone when it raises."""
        with self._lock:
            saved = {
                name: copy.deepcopy(value)
                for name, value in self.tables.__dict__.items()
                if name != "lock"
            }
            try:
                yield
            except BaseException:
                self.tables.__dict__.update(saved)
                raise

    def complete(self, lease: Lease, message_id: int, lease_seconds: float) -> None:
        """Delete a message whose receiver succeeded; fenced."""
        with self._lock:
            self._fence(lease, lease_seconds, healthy=True)
            self.tables.messages.pop(message_id, None)

    def discard(
        self,
        lease: Lease,
        ids: Sequence[int],
        counts: dict[str, int],
        lease_seconds: float,
    ) -> None:
        """Delete superseded messages and count them; fenced."""
        with self._lock:
            self._fence(lease, lease_seconds)
            for message_id in ids:
                self.tables.messages.pop(message_id, None)
            for category, count in counts.items():
                self.tables.coalesced[category] = (
                    self.tables.coalesced.get(category, 0) + count
                )

    def retry_later(
        self, lease: Lease, row: Row, attempts: int, delay: float, error: str
    ) -> None:
        """Back the shard off ``delay`` seconds, giving the lease up."""
        with self._lock:
            s = self._ours(lease)
            if s is None:
                return
            now = self.clock()
            s.attempts, s.head_id = attempts, row.id
            s.last_error = storable(error, ERROR_LIMIT, keep_end=True)
            s.failing_since = s.failing_since if s.failing_since is not None else now
            s.next_attempt_at = now + delay
            s.lease_token = s.leased_until = None

    def dead_letter(
        self, lease: Lease, row: Row, attempts: int, error: str, lease_seconds: float
    ) -> None:
        """Move the head to the dead letters; fenced."""
        with self._lock:
            self._fence(lease, lease_seconds, healthy=True)
            self.tables.dead.append(
                DeadLetter(
                    row.id,
                    row.category,
                    lease.shard,
                    row.object_id,
                    row.payload,
                    attempts,
                    storable(error, ERROR_LIMIT, keep_end=True),
                    self.clock(),
                )
            )
            self.tables.messages.pop(row.id, None)
            self.tables.dead_lettered[row.category] = (
                self.tables.dead_lettered.get(row.category, 0) + 1
            )

    def hold(self, lease: Lease, category: str, recheck_seconds: float) -> None:
        """Stop at a head whose category is paused; look again later."""
        with self._lock:
            s = self._ours(lease)
            if s is not None:
                s.held_by, s.next_attempt_at = category, self.clock() + recheck_seconds
                s.lease_token = s.leased_until = None

    def release(self, lease: Lease) -> None:
        """Give the shard up: gone when empty, else due now."""
        with self._lock:
            s = self._ours(lease)
            if s is not None and not self._in(lease.shard):
                del self.tables.shards[lease.shard]
                return
            self.requeue(lease)

    def requeue(self, lease: Lease) -> None:
        """Give the lease up with the shard due now."""
        with self._lock:
            s = self._ours(lease)
            if s is not None:
                s.held_by, s.next_attempt_at = "", self.clock()
                s.lease_token = s.leased_until = None

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend the lease; False once it is no longer ours."""
        with self._lock:
            s = self._ours(lease)
            if s is None:
                return False
            s.leased_until = self.clock() + lease_seconds
            return True

    def pauses(self) -> Pauses:
        """The categories and shards paused."""
        with self._lock:
            return Pauses(
                frozenset(self.tables.paused_categories),
                frozenset(self.tables.paused_shards),
            )

    def leftover(self) -> HandlerLeftover:
        """The messages no processor holds, by what they wait for."""
        with self._lock:
            t, now = self.tables, self.clock()
            unheld = [s for s in t.shards.values() if self._free(s, now)]
            failing = sorted(
                (s for s in unheld if s.attempts > 0),
                key=lambda s: (s.failing_since or 0.0, s.pk),
            )
            healthy = [s for s in unheld if s.attempts == 0]
            held = [
                s
                for s in healthy
                if s.shard in t.paused_shards or s.held_by in t.paused_categories
            ]
            waiting = [s for s in healthy if s not in held]

            def count(shards: list[_Shard]) -> int:
                keys = {s.shard for s in shards}
                return sum(1 for m in t.messages.values() if m.shard in keys)

            return HandlerLeftover(
                database=self.using,
                failing=count(failing),
                failing_shards=len([s for s in failing if self._in(s.shard)]),
                failing_shard=failing[0].shard if failing else "",
                failing_error=failing[0].last_error if failing else "",
                waiting=count(waiting),
                held=count(held),
                held_by_shards=tuple(
                    sorted({s.shard for s in healthy} & t.paused_shards)
                ),
                held_by_categories=tuple(
                    sorted({s.held_by for s in healthy} & t.paused_categories)
                ),
            )

    def pause(self, kind: str, value: str, reason: str = "") -> bool:
        """Pause a ``"category"`` or a ``"shard"``; False when it already was."""
        with self._lock:
            paused = self._paused(kind)
            if value in paused:
                return False
            paused.add(value)
            return True

    def resume(self, kind: str, value: str) -> bool:
        """Lift a pause; shards it stopped are due again. False when none."""
        with self._lock:
            paused = self._paused(kind)
            if value not in paused:
                return False
            paused.discard(value)
            for s in self.tables.shards.values():
                if (kind == "category" and s.held_by == value) or (
                    kind == "shard" and s.shard == value and s.attempts == 0
                ):
                    s.held_by, s.next_attempt_at = "", self.clock()
            return True

    # -- heartbeats and retention -------------------------------------------------

    def beat(self, relay_id: str, name: str) -> None:
        """Record that processor ``relay_id`` is alive now."""
        with self._lock:
            self.tables.processors[relay_id] = self.clock()

    def take_over(self, stale_seconds: float) -> int:
        """End the leases of processors silent for ``stale_seconds``; how many."""
        with self._lock:
            now = self.clock()
            stale = {
                p
                for p, seen in self.tables.processors.items()
                if seen < now - stale_seconds
            }
            ended = 0
            for s in self.tables.shards.values():
                if s.holder in stale and s.lease_token is not None:
                    s.leased_until, s.holder = now - 1.0, None
                    ended += 1
            for p in stale:
                del self.tables.processors[p]
            return ended

    def leave(self, relay_id: str) -> None:
        """Remove processor ``relay_id``'s heartbeat."""
        with self._lock:
            self.tables.processors.pop(relay_id, None)

    def purge_dead_letters(self, older_than: float, chunk: int = 1000) -> int:
        """Delete dead letters older than ``older_than`` seconds; how many."""
        with self._lock:
            limit = self.clock() - older_than
            kept = [d for d in self.tables.dead if d.died_at >= limit]
            deleted = len(self.tables.dead) - len(kept)
            self.tables.dead = kept
            return deleted

    def reset_connection(self) -> None:
        """Nothing to reset in memory."""

    # -- internals -------------------------------------------------------------

    def _in(self, shard: str) -> list[_Message]:
        return sorted(
            (m for m in self.tables.messages.values() if m.shard == shard),
            key=lambda m: m.id,
        )

    def _free(self, s: _Shard, now: float) -> bool:
        return s.lease_token is None or (
            s.leased_until is not None and s.leased_until < now
        )

    def _ours(self, lease: Lease) -> _Shard | None:
        s = self.tables.shards.get(lease.shard)
        if s is None or s.pk != lease.pk or s.lease_token != lease.token:
            return None
        return s

    def _fence(
        self, lease: Lease, lease_seconds: float, *, healthy: bool = False
    ) -> None:
        s = self._ours(lease)
        if s is None:
            raise LeaseLost(
                f"the lease on shard {lease.shard!r} ended; another processor owns it"
            )
        s.leased_until = self.clock() + lease_seconds
        if healthy:
            s.attempts, s.head_id, s.failing_since, s.last_error = 0, None, None, ""

    def _paused(self, kind: str) -> set[str]:
        if kind == "category":
            return self.tables.paused_categories
        if kind == "shard":
            return self.tables.paused_shards
        raise ValueError(f"a pause is of a 'category' or a 'shard', not {kind!r}")
