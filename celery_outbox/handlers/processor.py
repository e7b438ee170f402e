"""The handler processor: a lane of the engine that runs receivers, shard by shard.

Each turn claims due shards, runs their receivers in order, settles and repeats;
the loop around it is the engine's (:mod:`celery_outbox.engine.loop`): stop on
SIGTERM, the liveness file, a heartbeat that takes over a dead processor's shards
within seconds. No database transaction is open while a receiver runs unless its
category asks for one (``atomic=True``, the default), and then only on the
outbox's database. The engine's lease keeper renews the shard's lease while
receivers run, so a receiver may take minutes.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from django.db import connections, router

from ..conf import OutboxSettings, get_settings
from ..engine.heartbeat import Heartbeat, new_member_id
from ..engine.lease import LeaseKeeper
from ..engine.loop import Left, Loop, Pacing, Turn
from ..engine.observations import LoopError, StopReason, notify
from ..exceptions import OutboxDatabaseError
from ..outcomes import Action
from ..store.handlers import (
    HandlerLeases,
    Lease,
    LeaseLost,
    Pauses,
    StatementRefused,
)
from ..store.handlers.sql import HandlerMembers, HandlerStore
from ..text import unrecorded
from .core import Plan, Row, after_failure, coalesce, left_of
from .models import HandlerMessage
from .observations import (
    HandlerObserver,
    MessageHandled,
    MessagesCoalesced,
    PassDone,
)
from .registry import Category, Registry, registry

logger = logging.getLogger("celery_outbox.handlers")


@dataclass(frozen=True)
class ProcessorConfig:
    """How a processor runs; :func:`config_from_settings` fills it from Django settings."""

    databases: tuple[str, ...]
    lease_seconds: float = 30.0
    retry_base_seconds: float = 1.0
    retry_max_seconds: float = 3600.0
    poll_interval: float = 1.0
    #: Messages read from a shard at once. Coalescing looks at the whole shard.
    window: int = 100
    #: Windows run per claim before the shard goes back to the queue (fairness).
    windows_per_claim: int = 10
    #: Seconds between sweeps for messages whose shard row is missing.
    discover_interval: float = 10.0
    #: A shard stopped by a paused category is looked at again after this long.
    pause_recheck_seconds: float = 30.0
    until_empty: bool = False
    #: Touched at least every ``liveness_interval`` seconds while the processor runs.
    liveness_file: str | None = None
    liveness_interval: float = 5.0
    #: How often :meth:`Processor.run` beats; a processor silent for three beats has
    #: its shards taken by the others. None: no heartbeat (leases then just expire).
    heartbeat_interval: float | None = 1.5


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


class Processor:
    """Runs the receivers of due shards on the configured databases: a lane."""

    def __init__(
        self,
        config: ProcessorConfig,
        categories: Registry = registry,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        observers: Sequence[HandlerObserver] = (),
        random_source: Callable[[], float] = random.random,
        stores: Callable[..., HandlerLeases] = HandlerStore,
    ) -> None:
        self.config = config
        #: ``stores(alias, holder=member id)``: the store of one database (SQL by
        #: default; :class:`~celery_outbox.store.handlers.MemoryHandlerStore` in tests).
        self.stores = stores
        self.categories = categories
        self.observers: list[HandlerObserver] = list(observers)
        self.random = random_source
        self._monotonic = monotonic
        self._discovered_at: dict[str, float] = {}
        #: Leases a database error left held, per alias: given back at the next pass.
        self._interrupted: dict[str, list[Lease]] = {}
        #: Why the last pass failed, if it did.
        self._failure: str | None = None
        #: This processor's heartbeat id, written on the shards it claims.
        self.member_id = new_member_id()
        self._by_alias = {
            alias: stores(alias, holder=self.member_id) for alias in config.databases
        }
        self.loop = Loop(
            self,
            Pacing(
                poll_interval=config.poll_interval,
                min_poll_interval=config.poll_interval,
                liveness_file=config.liveness_file,
                liveness_interval=config.liveness_interval,
                until_empty=config.until_empty,
            ),
            clock=monotonic,
            observers=self.observers,
        )
        if config.heartbeat_interval is not None:
            self.loop.heartbeat = Heartbeat(
                HandlerMembers(list(self._by_alias.values()), self.member_id),
                config.heartbeat_interval,
                # Shards taken over from a dead processor are due now.
                on_takeover=self.loop.waiter.wake,
                what="handler processor",
                log=logger,
            )

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand; safe in a signal handler."""
        self.loop.stop()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self.loop.stopping

    def run(self) -> StopReason:
        """Process until stopped (or, with ``until_empty``, until no shard is due)."""
        return self.loop.run()

    # -- the lane --------------------------------------------------------------

    def turn(self) -> Turn:
        """One pass over every database (:meth:`run_once`)."""
        claimed, failed = self._run_once()
        if claimed:
            return Turn.FULL
        return Turn.PAUSED if failed else Turn.EMPTY

    def paused_for(self) -> float:
        """After a database error: the poll interval."""
        return self.config.poll_interval

    def next_due(self) -> float:
        """Backoffs are polled for (the database holds them): nothing to wake for."""
        return math.inf

    def finish(self) -> None:
        """Nothing is left to settle: every message settles in its own turn."""

    def left(self) -> Left:
        """What the databases hold when a run ends (:func:`.core.left_of`), and why
        the last pass failed, if it did.

        Read from the state, whichever run left it: a shard backing off after an
        earlier run's failure is as unfinished as one this run backed off. A
        database that does not answer is unfinished too.
        """
        found = []
        failures = [self._failure] if self._failure else []
        for alias in self.config.databases:
            store = self._by_alias[alias]
            try:
                found.append(store.leftover())
            except OutboxDatabaseError as exc:
                failures.append(f"what is left on {alias} could not be read: {exc}")
                logger.error("reading what is left on %r failed: %s", alias, exc)
                store.reset_connection()
        return left_of(found, failures)

    def run_once(self) -> int:
        """One pass over every database; returns how many shards were claimed."""
        return self._run_once()[0]

    def _run_once(self) -> tuple[int, bool]:
        claimed = 0
        failed = False
        self._failure = None
        for alias in self.config.databases:
            store = self._by_alias[alias]
            try:
                claimed += self._pass(store)
            except OutboxDatabaseError as exc:
                failed = True
                self._failure = f"the last pass failed: {exc}"
                logger.error("handler pass on database %r failed: %s", alias, exc)
                notify(self.observers, LoopError(f"pass on {alias}", str(exc)))
                store.reset_connection()
        notify(self.observers, PassDone(claimed))
        return claimed, failed

    def flush(self, alias: str, shards: Iterable[str]) -> None:
        """Process ``shards`` now, unless another processor holds them (on commit)."""
        store = self.stores(alias, holder=None)
        keys = sorted(set(shards))
        store.ensure_shards(keys)
        while keys:
            lease = store.claim(_token(), self.config.lease_seconds, keys)
            if lease is None:
                return
            keys.remove(lease.shard)
            self.process(store, lease)

    def _pass(self, store: HandlerLeases) -> int:
        self._give_back(store)
        self._discover(store)
        claimed = 0
        while not self.stopping:
            lease = store.claim(_token(), self.config.lease_seconds)
            if lease is None:
                break
            claimed += 1
            self.process(store, lease)
        return claimed

    def _give_back(self, store: HandlerLeases) -> None:
        """Make the shards a database error interrupted due again, no attempt charged.

        Their leases are still in the database; left there, the shards would wait
        out the whole lease once the database is back.
        """
        leases = self._interrupted.get(store.using, [])
        while leases:
            store.requeue(leases[-1])
            leases.pop()

    def _discover(self, store: HandlerLeases) -> None:
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

    def process(self, store: HandlerLeases, lease: Lease) -> None:
        """Run the shard's messages in order while the lease holds, then give it up."""
        seconds = self.config.lease_seconds
        keeper = LeaseKeeper(
            lambda: store.renew(lease, seconds),
            seconds,
            name=f"lease on shard {lease.shard!r}",
            done=store.reset_connection,  # the keeper thread's connection
            log=logger,
        )
        with keeper:
            try:
                self._drain(store, lease)
            except LeaseLost:
                logger.warning(
                    "shard %r was taken over (lease ended); its current message "
                    "was rolled back or will run again",
                    lease.shard,
                )
            except OutboxDatabaseError:
                self._interrupted.setdefault(store.using, []).append(lease)
                raise

    def _drain(self, store: HandlerLeases, lease: Lease) -> None:
        for _ in range(self.config.windows_per_claim):
            pauses = store.pauses()
            if lease.shard in pauses.shards or self.stopping:
                store.requeue(lease)
                return
            rows = store.read(lease, self.config.window)
            read_at = self._monotonic()
            if not rows:
                store.release(lease)
                return
            plan = coalesce(
                rows, self.categories.coalesces, self._newest(store, lease, rows)
            )
            if plan.superseded:
                store.discard(
                    lease, plan.superseded, plan.coalesced, self.config.lease_seconds
                )
                notify(
                    self.observers,
                    MessagesCoalesced(store.using, lease.shard, plan.coalesced),
                )
            if not self._run_window(store, lease, plan, pauses, read_at):
                return
        store.requeue(lease)

    def _newest(
        self, store: HandlerLeases, lease: Lease, rows: Sequence[Row]
    ) -> dict[tuple[str, str], int]:
        """Newer ids of the window's coalescing objects further on in the shard."""
        if len(rows) < self.config.window:
            return {}  # the whole shard was read
        coalescing = [r for r in rows if self.categories.coalesces(r.category)]
        return store.newest(lease, coalescing) if coalescing else {}

    def _run_window(
        self,
        store: HandlerLeases,
        lease: Lease,
        plan: Plan,
        pauses: Pauses,
        read_at: float,
    ) -> bool:
        """Run a window's rows; False when the shard stopped (failure, pause, stop).

        The pauses are read again before every message after the first (the window's
        read saw them for it): a pause stops a running shard at the next message, and
        a stop ends it after the message in hand, not at the end of the window.
        """
        for index, row in enumerate(plan.run):
            if index:
                pauses = store.pauses()
            if self.stopping or lease.shard in pauses.shards:
                store.requeue(lease)
                return False
            if row.category in pauses.categories:
                store.hold(lease, row.category, self.config.pause_recheck_seconds)
                return False
            if self.run_one(store, lease, row, read_at) is Action.RETRY:
                return False
        return True

    def run_one(
        self, store: HandlerLeases, lease: Lease, row: Row, read_at: float | None = None
    ) -> Action:
        """Run one message's receiver, settle it, and report it to the observers.

        ``read_at``: the monotonic time the row was read, to report its age.
        """
        # A pass drains every due shard: with a backlog it outlasts any liveness
        # probe unless each message says the processor is alive (once a second at most).
        self.loop.touch_liveness()
        started = self._monotonic()
        attempt = (lease.attempts if lease.head_id == row.id else 0) + 1
        action = self._run_and_settle(store, lease, row, attempt)
        if self.observers:
            ended = self._monotonic()
            age = None
            if row.age_seconds is not None and read_at is not None:
                age = row.age_seconds + max(0.0, ended - read_at)
            event = MessageHandled(
                store.using,
                lease.shard,
                row.category,
                action,
                attempt,
                max(0.0, ended - started),
                age,
            )
            notify(self.observers, event)
        return action

    def _run_and_settle(
        self, store: HandlerLeases, lease: Lease, row: Row, attempt: int
    ) -> Action:
        category = self.categories.get(row.category)
        try:
            self._call(store, lease, row, category, attempt)
        except _ReceiverFailed as failed:
            return self._failed(store, lease, row, category, attempt, failed.error)
        return Action.DELETE

    def _call(
        self,
        store: HandlerLeases,
        lease: Lease,
        row: Row,
        category: Category | None,
        attempt: int,
    ) -> None:
        """Run the receiver and delete the message; a receiver's error is wrapped.

        The store's own errors (:class:`LeaseLost`, :class:`OutboxDatabaseError`)
        pass through: they are not the receiver's fault. Except one: an atomic
        receiver's transaction that the database refuses to complete
        (:class:`StatementRefused`) failed with its receiver.
        """
        if category is None:
            raise _ReceiverFailed(
                LookupError(
                    f"no receiver is registered for handler category "
                    f"{row.category!r} in this process"
                )
            )
        try:
            payload = json.loads(row.payload)
        except ValueError as exc:  # edited by hand: fails like its receiver would
            raise _ReceiverFailed(exc) from exc
        kwargs = {
            "shard": lease.shard,
            "object_id": row.object_id,
            "payload": payload,
            "category": row.category,
            "message_id": row.id,
            "attempt": attempt,
            "created_at": row.created_at,
        }
        seconds = self.config.lease_seconds
        if category.atomic:
            try:
                with store.atomic():
                    _receive(category, kwargs)
                    store.complete(lease, row.id, seconds)
            except StatementRefused as exc:
                # The receiver's transaction cannot commit (a database error it
                # swallowed, a constraint checked at COMMIT): its failure, charged.
                raise _ReceiverFailed(exc) from exc
            return
        _receive(category, kwargs)
        with store.atomic():
            store.complete(lease, row.id, seconds)

    def _failed(
        self,
        store: HandlerLeases,
        lease: Lease,
        row: Row,
        category: Category | None,
        attempt: int,
        exc: BaseException,
    ) -> Action:
        """Charge the attempt: back the shard off, or dead-letter its head.

        The store makes the traceback storable; should the database refuse it all the
        same, the failure is recorded once more with a note in its place
        (:func:`~celery_outbox.text.unrecorded`): the attempt still counts, instead
        of the receiver running again at every pass with nothing charged.
        """
        error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            return self._charge(store, lease, row, category, attempt, error)
        except OutboxDatabaseError as refused:
            logger.error(
                "handler %r failed on shard %r, and its error could not be recorded "
                "(%s); recording a note instead",
                row.category,
                lease.shard,
                refused,
            )
            note = unrecorded(exc, refused)
            return self._charge(store, lease, row, category, attempt, note)

    def _charge(
        self,
        store: HandlerLeases,
        lease: Lease,
        row: Row,
        category: Category | None,
        attempt: int,
        error: str,
    ) -> Action:
        max_attempts = category.max_attempts if category is not None else None
        decision = after_failure(
            row.id,
            attempt,
            max_attempts,
            self.config.retry_base_seconds,
            self.config.retry_max_seconds,
            self.random,
        )
        if decision.action is Action.DEAD_LETTER:
            logger.error(
                "handler %r failed %d time(s) on shard %r: message %d dead-lettered",
                row.category,
                attempt,
                lease.shard,
                row.id,
            )
            store.dead_letter(lease, row, attempt, error, self.config.lease_seconds)
            return Action.DEAD_LETTER
        logger.warning(
            "handler %r failed on shard %r (attempt %d); retry in %.1f s",
            row.category,
            lease.shard,
            attempt,
            decision.delay,
        )
        store.retry_later(lease, row, attempt, decision.delay, error)
        return Action.RETRY


class _ReceiverFailed(Exception):
    """A receiver raised ``error`` (kept apart from the store's own errors)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _receive(category: Category, kwargs: dict[str, Any]) -> None:
    try:
        category.receiver(**kwargs)
    except Exception as exc:  # the receiver's failure, whatever it is
        raise _ReceiverFailed(exc) from exc


def _token() -> str:
    return uuid.uuid4().hex


def flush_shards(alias: str, shards: Sequence[str]) -> None:
    """Run ``shards`` in this process now; failures are logged, rows stay for the processor."""
    try:
        from .metrics import flush_observers

        settings = get_settings()
        config = config_from_settings(settings, databases=(alias,))
        processor = Processor(config, observers=flush_observers(settings))
        processor.flush(alias, shards)
    except Exception:
        logger.exception(
            "flushing handler shards on %r failed; the processor will run them", alias
        )
