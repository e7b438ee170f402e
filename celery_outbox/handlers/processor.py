"""The handler processor: claim a shard, run its receivers in order, settle, repeat.

No database transaction is open while a receiver runs unless its category asks for
one (``atomic=True``, the default), and then only on the outbox's database. A thread
renews the shard's lease while receivers run, so a receiver may take minutes.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType

from django.db import DatabaseError, InterfaceError, connections, router, transaction

from ..conf import OutboxSettings, get_settings
from .core import Plan, Row, Verdict, after_failure, coalesce
from .events import (
    HandlerListener,
    MessageHandled,
    MessagesCoalesced,
    Outcome,
    PassDone,
    emit,
)
from .models import HandlerMessage
from .registry import Category, Registry, registry
from .store import HandlerStore, Lease, LeaseLost, Pauses

logger = logging.getLogger("celery_outbox.handlers")


@dataclass(frozen=True)
class ProcessorConfig:
    """How a processor runs; :func:`config_from_settings` fills it from Django settings."""

    databases: tuple[str, ...]
    lease_seconds: float = 30.0
    retry_base_seconds: float = 1.0
    retry_max_seconds: float = 3600.0
    poll_interval: float = 1.0
    #: Messages read from a shard at once (the window coalescing looks at).
    window: int = 100
    #: Windows run per claim before the shard goes back to the queue (fairness).
    windows_per_claim: int = 10
    #: Seconds between sweeps for messages whose shard row is missing.
    discover_interval: float = 10.0
    #: A shard stopped by a paused category is looked at again after this long.
    pause_recheck_seconds: float = 30.0
    until_empty: bool = False


def default_databases(settings: OutboxSettings) -> tuple[str, ...]:
    """The configured aliases, or every alias the handler tables may live on."""
    if settings.handler_databases is not None:
        return settings.handler_databases
    return tuple(
        alias
        for alias in connections
        if router.allow_migrate_model(alias, HandlerMessage)
    )


def config_from_settings(
    settings: OutboxSettings | None = None, **overrides: object
) -> ProcessorConfig:
    """A config from ``CELERY_OUTBOX_*``; ``overrides`` that are None are ignored."""
    settings = settings or get_settings()
    config = ProcessorConfig(
        databases=default_databases(settings),
        lease_seconds=settings.handler_lease_seconds,
        retry_base_seconds=settings.handler_retry_base_seconds,
        retry_max_seconds=settings.handler_retry_max_seconds,
        poll_interval=settings.poll_interval,
    )
    given = {name: value for name, value in overrides.items() if value is not None}
    return replace(config, **given)  # type: ignore[arg-type]


class StopReason(str, enum.Enum):
    """Why :meth:`Processor.run` returned."""

    STOPPED = "stopped"
    EMPTY = "empty"


class Renewer:
    """A thread that extends a lease every third of its length while receivers run."""

    def __init__(self, store: HandlerStore, lease: Lease, lease_seconds: float) -> None:
        self._store = store
        self._lease = lease
        self._seconds = lease_seconds
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"handler-lease-{lease.shard}", daemon=True
        )
        #: Set when a renewal found the lease gone.
        self.lost = False

    def __enter__(self) -> Renewer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join(timeout=self._seconds)

    def _run(self) -> None:
        try:
            while not self._done.wait(self._seconds / 3):
                if not self._store.renew(self._lease, self._seconds):
                    self.lost = True
                    logger.warning("lease on shard %r lost", self._lease.shard)
                    return
        except Exception:
            logger.exception("renewing the lease on %r failed", self._lease.shard)
        finally:
            connections[self._store.using].close()


class Processor:
    """Runs the receivers of due shards on the configured databases."""

    def __init__(
        self,
        config: ProcessorConfig,
        categories: Registry = registry,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        listeners: Sequence[HandlerListener] = (),
    ) -> None:
        self.config = config
        self.categories = categories
        self.listeners = tuple(listeners)
        self._monotonic = monotonic
        self._stop = threading.Event()
        self._discovered_at: dict[str, float] = {}
        #: Leases a database error left held, per alias: given back at the next pass.
        self._interrupted: dict[str, list[Lease]] = {}

    def stop(self) -> None:
        """Ask :meth:`run` to return after the shard in hand."""
        self._stop.set()

    def run(self) -> StopReason:
        """Process until stopped (or, with ``until_empty``, until no shard is due)."""
        while not self._stop.is_set():
            if self.run_once():
                continue
            if self.config.until_empty:
                return StopReason.EMPTY
            self._stop.wait(self.config.poll_interval)
        return StopReason.STOPPED

    def run_once(self) -> int:
        """One pass over every database; returns how many shards were claimed."""
        claimed = 0
        for alias in self.config.databases:
            try:
                claimed += self._pass(HandlerStore(alias))
            except Exception:
                logger.exception("handler pass on database %r failed", alias)
                connections[alias].close()
        emit(self.listeners, PassDone(claimed))
        return claimed

    def flush(self, alias: str, shards: Iterable[str]) -> None:
        """Process ``shards`` now, unless another processor holds them (on commit)."""
        store = HandlerStore(alias)
        keys = sorted(set(shards))
        store.ensure_shards(keys)
        while keys:
            lease = store.claim(_token(), self.config.lease_seconds, keys)
            if lease is None:
                return
            keys.remove(lease.shard)
            self.process(store, lease)

    def _pass(self, store: HandlerStore) -> int:
        self._give_back(store)
        self._discover(store)
        claimed = 0
        while not self._stop.is_set():
            lease = store.claim(_token(), self.config.lease_seconds)
            if lease is None:
                break
            claimed += 1
            self.process(store, lease)
        return claimed

    def _give_back(self, store: HandlerStore) -> None:
        """Make the shards a database error interrupted due again, no attempt charged.

        Their leases are still in the database; left there, the shards would wait
        out the whole lease once the database is back.
        """
        leases = self._interrupted.get(store.using, [])
        while leases:
            store.requeue(leases[-1])
            leases.pop()

    def _discover(self, store: HandlerStore) -> None:
        now = self._monotonic()
        last = self._discovered_at.get(store.using)
        if self.config.until_empty or last is None:
            due = True
        else:
            due = now - last >= self.config.discover_interval
        if due:
            self._discovered_at[store.using] = now
            found = store.discover()
            if found:
                logger.info("%d shard(s) without a shard row recovered", found)

    def process(self, store: HandlerStore, lease: Lease) -> None:
        """Run the shard's messages in order while the lease holds, then give it up."""
        with Renewer(store, lease, self.config.lease_seconds):
            try:
                self._drain(store, lease)
            except LeaseLost:
                logger.warning(
                    "shard %r was taken over (lease ended); its current message "
                    "was rolled back or will run again",
                    lease.shard,
                )
            except (DatabaseError, InterfaceError):
                self._interrupted.setdefault(store.using, []).append(lease)
                raise

    def _drain(self, store: HandlerStore, lease: Lease) -> None:
        for _ in range(self.config.windows_per_claim):
            pauses = store.pauses()
            if lease.shard in pauses.shards or self._stop.is_set():
                store.requeue(lease)
                return
            rows = store.read(lease, self.config.window)
            read_at = self._monotonic()
            if not rows:
                store.release(lease)
                return
            plan = coalesce(rows, self.categories.coalesces)
            if plan.superseded:
                store.discard(
                    lease, plan.superseded, plan.coalesced, self.config.lease_seconds
                )
                emit(
                    self.listeners,
                    MessagesCoalesced(store.using, lease.shard, plan.coalesced),
                )
            if not self._run_window(store, lease, plan, pauses, read_at):
                return
        store.requeue(lease)

    def _run_window(
        self,
        store: HandlerStore,
        lease: Lease,
        plan: Plan,
        pauses: Pauses,
        read_at: float,
    ) -> bool:
        """Run a window's rows; False when the shard stopped (failure or pause)."""
        for row in plan.run:
            if row.category in pauses.categories:
                store.hold(lease, row.category, self.config.pause_recheck_seconds)
                return False
            if self.run_one(store, lease, row, read_at) is Outcome.RETRY:
                return False
        return True

    def run_one(
        self, store: HandlerStore, lease: Lease, row: Row, read_at: float | None = None
    ) -> Outcome:
        """Run one message's receiver, settle it, and report it to the listeners.

        ``read_at``: the monotonic time the row was read, to report its age.
        """
        started = self._monotonic()
        attempt = (lease.attempts if lease.head_id == row.id else 0) + 1
        outcome = self._run_and_settle(store, lease, row, attempt)
        if self.listeners:
            ended = self._monotonic()
            age = None
            if row.age_seconds is not None and read_at is not None:
                age = row.age_seconds + max(0.0, ended - read_at)
            event = MessageHandled(
                store.using,
                lease.shard,
                row.category,
                outcome,
                attempt,
                max(0.0, ended - started),
                age,
            )
            emit(self.listeners, event)
        return outcome

    def _run_and_settle(
        self, store: HandlerStore, lease: Lease, row: Row, attempt: int
    ) -> Outcome:
        category = self.categories.get(row.category)
        try:
            if category is None:
                raise LookupError(
                    f"no receiver is registered for handler category {row.category!r} "
                    f"in this process"
                )
            self._call(store, lease, row, category, attempt)
        except LeaseLost:
            raise
        except Exception as exc:
            error = "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__)
            )
            return self._failed(store, lease, row, category, attempt, error)
        return Outcome.DONE

    def _call(
        self,
        store: HandlerStore,
        lease: Lease,
        row: Row,
        category: Category,
        attempt: int,
    ) -> None:
        kwargs = {
            "shard": lease.shard,
            "object_id": row.object_id,
            "payload": json.loads(row.payload),
            "category": row.category,
            "message_id": row.id,
            "attempt": attempt,
            "created_at": row.created_at,
        }
        seconds = self.config.lease_seconds
        if category.atomic:
            with transaction.atomic(using=store.using):
                category.receiver(**kwargs)
                store.complete(lease, row.id, seconds)
            return
        category.receiver(**kwargs)
        with transaction.atomic(using=store.using):
            store.complete(lease, row.id, seconds)

    def _failed(
        self,
        store: HandlerStore,
        lease: Lease,
        row: Row,
        category: Category | None,
        attempt: int,
        error: str,
    ) -> Outcome:
        max_attempts = category.max_attempts if category is not None else None
        decision = after_failure(
            attempt,
            max_attempts,
            self.config.retry_base_seconds,
            self.config.retry_max_seconds,
        )
        if decision.verdict is Verdict.DEAD_LETTER:
            logger.error(
                "handler %r failed %d time(s) on shard %r: message %d dead-lettered",
                row.category,
                attempt,
                lease.shard,
                row.id,
            )
            store.dead_letter(lease, row, attempt, error, self.config.lease_seconds)
            return Outcome.DEAD_LETTER
        logger.warning(
            "handler %r failed on shard %r (attempt %d); retry in %.1f s",
            row.category,
            lease.shard,
            attempt,
            decision.delay,
        )
        store.retry_later(lease, row, decision, error)
        return Outcome.RETRY


def _token() -> str:
    return uuid.uuid4().hex


def flush_shards(alias: str, shards: Sequence[str]) -> None:
    """Run ``shards`` in this process now; failures are logged, rows stay for the processor."""
    try:
        from .metrics import flush_listeners

        settings = get_settings()
        config = config_from_settings(settings, databases=(alias,))
        processor = Processor(config, listeners=flush_listeners(settings))
        processor.flush(alias, shards)
    except Exception:
        logger.exception(
            "flushing handler shards on %r failed; the processor will run them", alias
        )
