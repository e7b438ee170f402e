"""The relay loop: claim → publish → decide → settle → wait.

The loop holds no database transaction while it talks to the broker: the claim
commits before the first publish, and the settlement is a second short transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..broker import Publisher, describe
from ..engine.gate import Gate
from ..engine.heartbeat import Heartbeat
from ..engine.loop import Left, Loop, Pacing, Turn, WakeupSource
from ..engine.observations import LoopError, StopReason, notify
from ..engine.waiter import Waiter
from ..envelope import StoredMessage
from ..exceptions import OutboxDatabaseError
from ..ordering.gate import KeyGate
from ..outcomes import Action, Decision, Outcome, PublishResult, Settlement
from ..store import Claim, RelayStore, SettleReport
from .config import RelayConfig
from .core import Breaker, Suspects, judge_alone, left_of, settle
from .observations import (
    BatchHook,
    BatchSettled,
    BreakerOpened,
    Coalesced,
    Observer,
    guarded,
    log_observation,
)

logger = logging.getLogger("celery_outbox.relay")


class Relay:
    """Moves committed outbox rows to the broker until stopped: a lane of the engine.

    :meth:`run` hands the relay to an :class:`~.engine.loop.Loop`, which calls
    :meth:`turn` (claim → publish → decide → settle) and rests between turns.
    """

    def __init__(
        self,
        store: RelayStore,
        publisher: Publisher,
        config: RelayConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        random_source: Callable[[], float] = random.random,
        waiter: Waiter | None = None,
        observers: Sequence[Observer] = (log_observation,),
        wakeup: WakeupSource | None = None,
        batch_hooks: Sequence[BatchHook] = (),
        heartbeat: Heartbeat | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.config = config
        #: What the relay may publish of each claimed batch (flow control), and
        #: what becomes of the rows it published (ordered keys); by default,
        #: ordered keys' policy alone.
        self.gate = gate if gate is not None else KeyGate(config.strict_lease_seconds)
        self.clock = clock
        self.random = random_source
        self.observers: list[Observer] = list(observers)
        #: Entered around each batch's publish and settlement (tracing).
        self.batch_hooks = list(batch_hooks)
        self.breaker = Breaker(config.breaker_threshold, config.policy.outage_cooldown)
        self.suspects = Suspects(config.isolate_after)
        #: Why the last turn could not reach the database, if it could not.
        self._trouble: str | None = None
        self._unsettled: tuple[str, Settlement] | None = None
        #: Set while :meth:`run` runs with ``config.prefetch`` on a database that
        #: takes concurrent claims.
        self._prefetcher: _Prefetcher | None = None
        #: The engine's loop that turns this lane; it beats ``heartbeat`` while it
        #: runs, so that a killed relay's rows are taken over long before their
        #: lease ends.
        self.loop = Loop(
            self,
            Pacing(
                poll_interval=config.poll_interval,
                min_poll_interval=config.min_poll_interval,
                liveness_file=config.liveness_file,
                liveness_interval=config.liveness_interval,
                until_empty=config.until_empty,
            ),
            clock=clock,
            waiter=waiter,
            observers=self.observers,
            wakeup=wakeup,
            heartbeat=heartbeat,
        )

    @property
    def waiter(self) -> Waiter:
        """The loop's waiter (a signal handler may wake it)."""
        return self.loop.waiter

    @property
    def wakeup(self) -> WakeupSource | None:
        """What wakes the idle loop when rows commit (LISTEN/NOTIFY), if anything."""
        return self.loop.wakeup

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The heartbeat the loop beats while it runs, if any."""
        return self.loop.heartbeat

    def stop(self) -> None:
        """Ask the loop to finish the current batch and return; safe in a signal handler.

        No new message is started; in-flight publishes get ``shutdown_timeout``;
        rows of the batch not yet sent are handed back at once.
        """
        self.loop.stop()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self.loop.stopping

    def run(self) -> StopReason:
        """Relay until stopped (or, with ``until_empty``, until nothing is due)."""
        with self.store.relay_lock():
            logger.info("relay started (database %r)", self.store.alias)
            if self.config.prefetch and self.store.concurrent_claims:
                self._prefetcher = _Prefetcher(self.store, self.clock)
            try:
                reason = self.loop.run()
            finally:
                self._close_prefetcher()
        self.publisher.close()
        if self.wakeup is not None:
            self.wakeup.close()
        return reason

    # -- the lane --------------------------------------------------------------

    def turn(self) -> Turn:
        """One turn of the engine's loop: :meth:`run_once`."""
        return self.run_once()

    def paused_for(self) -> float:
        """Rest while the breaker is open, else ``error_pause`` after an error."""
        if self.breaker.is_open(self.clock()):
            return self.breaker.open_until - self.clock()
        return self.config.error_pause

    def next_due(self) -> float:
        """Seconds until the next scheduled row falls due (the relay wakes for it)."""
        return self._seconds_until_due()

    def left(self) -> Left:
        """The rows left in the outbox, read from it (:func:`.core.left_of`); when
        it does not answer, why."""
        try:
            found = self.store.leftover()
        except OutboxDatabaseError as exc:
            self._database_failed("leftover", exc)
        else:
            return left_of(found)
        return Left(unfinished=self._trouble)

    def finish(self) -> None:
        """One last try at a settlement a database error left behind."""
        if self._unsettled is not None:
            # The batch was published, and rows left leased would go out again
            # once their lease ran out.
            self._retry_settlement()

    def run_once(self) -> Turn:
        """One turn: settle what is left over, then claim, publish and settle a batch."""
        if not self.settle_leftover():
            return Turn.PAUSED
        if self.breaker.is_open(self.clock()):
            self._hand_back_prefetched()
            return Turn.PAUSED
        try:
            leased_at, claim = self._next_claim()
        except OutboxDatabaseError as exc:
            self._database_failed("claim", exc)
            return Turn.PAUSED
        full = len(claim.messages) >= self.config.batch_size
        if full and self._prefetcher is not None and not self.stopping:
            # Busy: claim the next batch while this one goes to the broker.
            self._prefetcher.start(self.config.batch_size, self.config.lease_seconds)
        if not self.process(claim, leased_at=leased_at):
            return Turn.EMPTY
        return Turn.FULL if full else Turn.PARTIAL

    def settle_leftover(self) -> bool:
        """Retry the settlement a database error left behind; False if it failed again.

        Call it before claiming: its rows were published and, left leased, would go
        to the broker again once their lease ran out.
        """
        return self._unsettled is None or self._retry_settlement()

    def process(
        self,
        claim: Claim,
        started: float | None = None,
        *,
        leased_at: float | None = None,
    ) -> int:
        """Publish, decide and settle claimed rows; returns how many were claimed.

        ``started`` is when the batch's send timeout starts (default: now);
        ``leased_at`` when its lease was taken (default: ``started``).
        """
        started = self.clock() if started is None else started
        leased_at = started if leased_at is None else leased_at
        if claim.unreadable:
            self._settle(claim.token, Settlement(dead_letter=claim.unreadable))
        if claim.coalesced:
            notify(self.observers, Coalesced(claim.coalesced))
        if not claim.messages:
            return 0
        if not self.batch_hooks:
            self._publish_batch(claim, started, leased_at)
        else:
            with contextlib.ExitStack() as hooks:
                for hook in self.batch_hooks:
                    hooks.enter_context(guarded(hook, claim.messages))
                self._publish_batch(claim, started, leased_at)
        return len(claim.messages)

    def _publish_batch(self, claim: Claim, started: float, leased_at: float) -> None:
        """Ask the gate, publish what it admits, decide, settle and report
        :class:`BatchSettled`; the rows the gate holds back are released with it."""
        try:
            admission = self.gate.admit(claim.messages, claim.token)
        except OutboxDatabaseError as exc:
            # The rows come back after the pause, unsent. A flow decided before the
            # error keeps its record: it can only count too many, never too few.
            self._database_failed("gate", exc)
            pause = self.config.error_pause
            self._settle(
                claim.token,
                Settlement(
                    release=tuple(
                        Decision(m.id, Action.RELEASE, pause) for m in claim.messages
                    )
                ),
            )
            return
        messages = admission.admitted
        budget = _BatchBudget(
            self, claim.token, [m.id for m in messages], started, leased_at
        )
        publish_started = self.clock()
        results = self._publish(messages, budget) if messages else []
        publish_seconds = self.clock() - publish_started
        attempts = {m.id: m.attempts for m in messages}
        settlement = self.gate.settled(
            settle(results, attempts, self.config.policy, self.random), messages
        )
        if admission.held:
            settlement = dataclasses.replace(
                settlement, release=settlement.release + admission.held
            )
        self._note_breaker(results)
        self.suspects = self.suspects.after_batch(results)
        report = self._settle(claim.token, settlement)
        if report is not None:
            event = BatchSettled(
                claim.messages,
                tuple(results),
                settlement,
                report,
                self.clock() - started,
                publish_seconds,
            )
            notify(self.observers, event)

    # -- internals -------------------------------------------------------------

    def _publish(
        self, messages: Sequence[StoredMessage], budget: _BatchBudget
    ) -> list[PublishResult]:
        """Publish a batch; suspects (:class:`.core.Suspects`) go first, one at a time.

        Sent alone, a suspect either goes through, or breaks the connection with
        nothing else in flight and is charged for it (:func:`.core.judge_alone`).
        """
        alone = self.suspects.alone(m.id for m in messages)
        if not alone:
            return self.publisher.publish(messages, budget)
        done: dict[int, PublishResult] = {}
        for message in messages:
            if message.id not in alone:
                continue
            if not budget.keep_going():
                break
            result = judge_alone(self.publisher.publish([message], budget)[0])
            done[message.id] = result
            if result.outcome is Outcome.OUTAGE:
                # The broker is down (or refuses us): the rest waits for it too.
                return [
                    done.get(m.id) or PublishResult(m.id, Outcome.OUTAGE, result.error)
                    for m in messages
                ]
        rest = [m for m in messages if m.id not in done]
        if rest:
            done.update((r.message_id, r) for r in self.publisher.publish(rest, budget))
        return [done[m.id] for m in messages]

    def _next_claim(self) -> tuple[float, Claim]:
        """The prefetched claim if one is waiting and still fresh, else a new claim."""
        if self._prefetcher is not None:
            taken = self._prefetcher.take()
            if taken is not None:
                leased_at, claim = taken
                # Normally a few milliseconds old; one that waited out half its lease
                # (a slow settlement) goes back rather than risk a lapsed lease.
                if self.clock() - leased_at < self.config.lease_seconds / 2:
                    return leased_at, claim
                self._hand_back(claim)
        leased_at = self.clock()
        return leased_at, self.store.claim(
            self.config.batch_size, self.config.lease_seconds
        )

    def _hand_back(self, claim: Claim) -> None:
        """Release claimed rows unsent (no attempt used); unreadable rows still go dead."""
        release = tuple(Decision(m.id, Action.RELEASE) for m in claim.messages)
        self._settle(
            claim.token, Settlement(dead_letter=claim.unreadable, release=release)
        )

    def _hand_back_prefetched(self) -> None:
        if self._prefetcher is None:
            return
        try:
            taken = self._prefetcher.take()
        except OutboxDatabaseError as exc:
            self._database_failed("claim", exc)
            return
        if taken is not None:
            self._hand_back(taken[1])

    def _close_prefetcher(self) -> None:
        if self._prefetcher is None:
            return
        try:
            if self._unsettled is None:
                self._hand_back_prefetched()
        finally:
            self._prefetcher.close()
            self._prefetcher = None

    def _settle(self, token: str, settlement: Settlement) -> SettleReport | None:
        try:
            return self.store.settle(token, settlement)
        except OutboxDatabaseError as exc:
            # Published rows must not be published again: keep the decisions and
            # retry them before the next claim, while the lease still holds.
            self._unsettled = (token, settlement)
            self._database_failed("settle", exc)
            return None

    def _retry_settlement(self) -> bool:
        assert self._unsettled is not None
        token, settlement = self._unsettled
        self._unsettled = None
        return self._settle(token, settlement) is not None

    def _note_breaker(self, results: Sequence[PublishResult]) -> None:
        was_open = self.breaker.is_open(self.clock())
        self.breaker = self.breaker.after_batch(results, self.clock())
        if not was_open and self.breaker.is_open(self.clock()):
            reason = next((r.error for r in results if r.outcome is Outcome.OUTAGE), "")
            seconds = self.breaker.open_until - self.clock()
            notify(self.observers, BreakerOpened(seconds, reason))

    def _database_failed(self, stage: str, exc: OutboxDatabaseError) -> None:
        self._trouble = (
            f"the outbox database {self.store.alias!r} did not answer ({stage}): "
            f"{describe(exc)}"
        )
        notify(self.observers, LoopError(stage, describe(exc)))
        self.store.reset_connection()

    def _seconds_until_due(self) -> float:
        try:
            due = self.store.seconds_until_due()
        except OutboxDatabaseError as exc:
            self._database_failed("seconds_until_due", exc)
            return math.inf
        return math.inf if due is None else due


class _BatchBudget:
    """The relay's side of a batch: stop on shutdown, keep the lease, stay live."""

    def __init__(
        self,
        relay: Relay,
        token: str,
        ids: list[int],
        started: float,
        leased_at: float,
    ) -> None:
        self._relay = relay
        self._token = token
        self._ids = ids
        self._started = started
        self._renewed = leased_at

    def keep_going(self) -> bool:
        relay = self._relay
        relay.loop.touch_liveness()
        now = relay.clock()
        lease = relay.config.lease_seconds
        if now - self._renewed > lease / 3:
            # A slow batch must not let its lease run out under it.
            self._renewed = now
            try:
                relay.store.renew(self._token, self._ids, lease)
            except OutboxDatabaseError as exc:
                notify(relay.observers, LoopError("renew", describe(exc)))
        return not relay.stopping

    def deadline(self) -> float:
        relay = self._relay
        deadline = self._started + relay.config.send_timeout
        if relay.loop.stop_at is not None:
            deadline = min(deadline, relay.loop.stop_at + relay.config.shutdown_timeout)
        return deadline


class _Prefetcher:
    """Claims the next batch on a thread (and so a database connection) of its own.

    While the relay publishes a full batch, the next claim's round trip and commit
    run here, so the broker and the database work at the same time instead of in
    turn. At most one claim is ever pending.
    """

    def __init__(self, store: RelayStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="outbox-prefetch"
        )
        self._pending: Future[tuple[float, Claim]] | None = None

    def start(self, limit: int, lease_seconds: float) -> None:
        """Begin claiming up to ``limit`` rows, unless a claim is already pending."""
        if self._pending is None:
            self._pending = self._executor.submit(self._claim, limit, lease_seconds)

    def take(self) -> tuple[float, Claim] | None:
        """The pending claim and when it was leased (waiting for it); None if none.

        Raises :class:`OutboxDatabaseError` when that claim failed.
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for a pending claim, then close this thread's database connection."""
        self._executor.submit(self._store.reset_connection)
        self._executor.shutdown(wait=True)

    def _claim(self, limit: int, lease_seconds: float) -> tuple[float, Claim]:
        leased_at = self._clock()
        try:
            return leased_at, self._store.claim(limit, lease_seconds)
        except OutboxDatabaseError:
            self._store.reset_connection()  # this thread's connection
            raise
