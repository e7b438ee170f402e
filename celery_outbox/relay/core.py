"""The relay's decisions, as pure functions over values.

Nothing here talks to a database, a broker or a clock: time and randomness are
passed in, so every rule can be tested directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..engine.backoff import backoff as engine_backoff
from ..engine.loop import Left
from ..outcomes import Action, Decision, Outcome, PublishResult, Settlement
from ..store.types import Leftover


@dataclass(frozen=True)
class RetryPolicy:
    """How failed and deferred rows come back."""

    max_attempts: int
    base_seconds: float
    max_seconds: float
    outage_cooldown: float


def backoff(attempt: int, policy: RetryPolicy, random: Callable[[], float]) -> float:
    """Seconds before retry number ``attempt`` (1-based): :func:`.engine.backoff.backoff`."""
    return engine_backoff(
        max(attempt, 1), policy.base_seconds, policy.max_seconds, random
    )


def decide(
    result: PublishResult,
    attempts: int,
    policy: RetryPolicy,
    random: Callable[[], float],
) -> Decision:
    """Decide a row's fate from its publish outcome and the attempts it had used before."""
    if result.outcome is Outcome.PUBLISHED:
        return Decision(result.message_id, Action.DELETE)
    if result.outcome is Outcome.NOT_SENT:
        return Decision(result.message_id, Action.RELEASE, 0.0, result.error)
    if result.outcome is Outcome.OUTAGE:
        return Decision(
            result.message_id, Action.RELEASE, policy.outage_cooldown, result.error
        )
    used = attempts + 1
    if used >= policy.max_attempts:
        return Decision(result.message_id, Action.DEAD_LETTER, 0.0, result.error)
    return Decision(
        result.message_id, Action.RETRY, backoff(used, policy, random), result.error
    )


def settle(
    results: Iterable[PublishResult],
    attempts: Mapping[int, int],
    policy: RetryPolicy,
    random: Callable[[], float],
) -> Settlement:
    """:func:`decide` every result (``attempts``: row id -> attempts used) and group.

    Published rows, nearly all of a normal batch, go straight to ``delete``.
    """
    published: list[int] = []
    others: list[Decision] = []
    for result in results:
        if result.outcome is Outcome.PUBLISHED:
            published.append(result.message_id)
        else:
            others.append(decide(result, attempts[result.message_id], policy, random))
    if not others:
        return Settlement(delete=tuple(published))
    rest = Settlement.of(others)
    return Settlement(
        delete=tuple(published) + rest.delete,
        retry=rest.retry,
        dead_letter=rest.dead_letter,
        release=rest.release,
    )


@dataclass(frozen=True)
class Breaker:
    """A circuit breaker over broker outages, as an immutable value.

    After ``threshold`` consecutive batches that hit an outage, the breaker opens for
    ``cooldown`` seconds: the relay stops claiming instead of hammering a dead broker.
    """

    threshold: int
    cooldown: float
    consecutive_outages: int = 0
    open_until: float = 0.0

    def is_open(self, now: float) -> bool:
        """Whether claiming should wait at monotonic time ``now``."""
        return now < self.open_until

    def after_batch(self, results: Iterable[PublishResult], now: float) -> Breaker:
        """The breaker after a batch with these results."""
        outcomes = {r.outcome for r in results}
        if Outcome.PUBLISHED in outcomes or Outcome.FAILED in outcomes:
            return Breaker(self.threshold, self.cooldown)
        if Outcome.OUTAGE not in outcomes:
            return self
        count = self.consecutive_outages + 1
        open_until = now + self.cooldown if count >= self.threshold else self.open_until
        return Breaker(self.threshold, self.cooldown, count, open_until)


@dataclass(frozen=True)
class Suspects:
    """Rows that were in flight when a connection broke, and how many times.

    A message the broker cannot take at all (a frame over ``frame_max``) makes the
    broker close the whole connection: every message of its batch is an outage, and
    the messages before it, delivered but never confirmed, go out again each cycle.
    A row caught in ``threshold`` such breaks is sent alone next time: if the
    connection breaks again with only that row on it, the row is to blame
    (:func:`judge_alone`). Broker conditions (credentials, alarms) never count,
    because the publishers do not mark them ``in_flight``.
    """

    threshold: int
    #: (row id, breaks it was in flight for), most recent last.
    counts: tuple[tuple[int, int], ...] = ()
    #: Rows remembered at most; the oldest are forgotten first.
    limit: int = 10_000

    def alone(self, ids: Iterable[int]) -> frozenset[int]:
        """Which of ``ids`` to send one at a time."""
        counts = dict(self.counts)
        return frozenset(i for i in ids if counts.get(i, 0) >= self.threshold)

    def after_batch(self, results: Iterable[PublishResult]) -> Suspects:
        """The suspects after a batch with these results."""
        counts = dict(self.counts)
        changed = False
        for result in results:
            if result.outcome is Outcome.OUTAGE and result.in_flight:
                counts[result.message_id] = counts.pop(result.message_id, 0) + 1
                changed = True
            elif result.outcome is Outcome.PUBLISHED:
                # A failed suspect stays one: its retries must not break a batch.
                changed = counts.pop(result.message_id, None) is not None or changed
        if not changed:
            return self
        kept = tuple(counts.items())[-self.limit :]
        return Suspects(self.threshold, kept, self.limit)


def judge_alone(result: PublishResult) -> PublishResult:
    """The result of a suspect sent alone: breaking the connection alone is its fault.

    Charged as a failure (one attempt), so a message that always breaks the
    connection ends among the dead letters with the broker's reason, and stops no
    other row.
    """
    if result.outcome is not Outcome.OUTAGE or not result.in_flight:
        return result
    return PublishResult(
        result.message_id,
        Outcome.FAILED,
        f"The broker closed the connection each time this message was sent, the "
        f"last time with no other message in flight ({result.error}). The message is "
        f"likely too large for the broker (a header over its frame_max?).",
    )


def left_of(found: Leftover) -> Left:
    """What a relay run ``until_empty`` leaves, in words, from the rows ``found``.

    Rows put back after an outage or a refusal are work it could have done: the
    run is unfinished. Rows a limit holds back (a flow, an ordered key's head) are
    counted apart: the outbox is not empty, and nothing the relay could send is left.
    """
    unfinished = []
    if found.deferred:
        unfinished.append(
            f"{found.deferred} not published, no attempt used (deferred by a broker "
            f"outage, or not claimed yet): {found.deferred_error or 'no reason recorded'}"
        )
    if found.retrying:
        unfinished.append(
            f"{found.retrying} refused by the broker, waiting for their retry: "
            f"{found.retrying_error or 'no reason recorded'}"
        )
    held = []
    if found.flow_held:
        held.append(
            f"{found.flow_held} held back by a flow (its rate, or a flow key at its "
            f"limit; 'outbox flows stats' shows them)"
        )
    if found.key_held:
        held.append(
            f"{found.key_held} held by their ordered key (behind its running or "
            f"blocked head; 'outbox ordering stats' shows them)"
        )
    total = found.deferred + found.retrying
    return Left(
        unfinished=(
            f"{total} row(s) wait in the outbox unsent: " + "; ".join(unfinished)
            if unfinished
            else None
        ),
        held=(
            f"{found.flow_held + found.key_held} row(s) held by a limit: "
            + "; ".join(held)
            if held
            else None
        ),
    )
