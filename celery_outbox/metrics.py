"""Relay metrics, reported to Prometheus and StatsD (the sinks, :mod:`celery_outbox.sinks`).

Both backends get the same names, prefixed ``celery_outbox_``:

===============================  =========  ==============================================
name                             kind       meaning
===============================  =========  ==============================================
published_total                  counter    messages confirmed by the broker
failed_total                     counter    refused publishes that will be retried
dead_lettered_total              counter    messages moved to the dead-letter table
outages_total                    counter    messages put back because the broker was down
coalesced_total                  counter    unpublished rows dropped for a newer one (claim)
blocked_total                    counter    heads of ``block`` keys that failed for good
breaker_open                     gauge      1 while the relay pauses after outages (0 from
                                            the relay's start)
batch_duration_seconds           histogram  claim to settled, per batch
publish_seconds                  histogram  the broker part of a batch (confirms included)
commit_to_publish_seconds        histogram  row written (a scheduled task: its ETA) to broker
                                            confirmed, per message
pending / due / dead             gauge      backlog, sampled every ``sample_every`` seconds
scheduled                        gauge      rows held until their ETA (sampled)
oldest_pending_seconds           gauge      age of the oldest waiting row (sampled;
                                            a scheduled row counts from its ETA)
blocked_keys                     gauge      ordered keys stopped by a blocked head
                                            (sampled)
===============================  =========  ==============================================

The counters and ``breaker_open`` exist from the relay's start (at 0): Prometheus'
``increase()`` then sees the first dead letter after a restart, and ``absent()`` of
them means that no relay is scraped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .outcomes import Outcome
from .relay.observations import BatchSettled, BreakerOpened, Coalesced, RelayObservation
from .sinks import Sink
from .store import OperatorStore, Stats

logger = logging.getLogger("celery_outbox.metrics")

#: The relay's counters, reported at 0 when its metrics start.
RELAY_COUNTERS = (
    "published_total",
    "failed_total",
    "dead_lettered_total",
    "outages_total",
    "coalesced_total",
    "blocked_total",
)


class RelayMetrics:
    """A relay listener that turns events into metrics, and samples the backlog."""

    def __init__(
        self,
        sink: Sink,
        store: OperatorStore | None = None,
        *,
        sample_every: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.store = store
        self.sample_every = sample_every
        self.clock = clock
        self._sampled_at: float | None = None
        # A series that appears only at its first increment hides that increment
        # from increase() and rate(); a relay starts with its breaker closed.
        for name in RELAY_COUNTERS:
            sink.count(name, 0)
        sink.gauge("breaker_open", 0)

    def __call__(self, event: RelayObservation) -> None:
        """Record one relay event."""
        if isinstance(event, BreakerOpened):
            self.sink.gauge("breaker_open", 1)
            return
        if isinstance(event, Coalesced):
            self.sink.count("coalesced_total", len(event.rows))
            return
        if not isinstance(event, BatchSettled):
            # An idle or paused relay still refreshes the backlog gauges.
            self._maybe_sample()
            return
        outcomes = [r.outcome for r in event.results]
        published = outcomes.count(Outcome.PUBLISHED)
        self.sink.count("published_total", published)
        self.sink.count("failed_total", len(event.settlement.retry))
        self.sink.count("dead_lettered_total", len(event.settlement.dead_letter))
        if event.settlement.block:
            self.sink.count("blocked_total", len(event.settlement.block))
        self.sink.count("outages_total", outcomes.count(Outcome.OUTAGE))
        if published or outcomes.count(Outcome.FAILED):
            # The broker answered (even with a refusal): the relay's breaker closed.
            self.sink.gauge("breaker_open", 0)
        self.sink.observe("batch_duration_seconds", event.seconds)
        self.sink.observe("publish_seconds", event.publish_seconds)
        published_ids = set(event.settlement.delete)
        published_ids.update(d.message_id for d in event.settlement.hold)
        for message in event.messages:
            if message.id in published_ids and message.age_seconds is not None:
                self.sink.observe(
                    "commit_to_publish_seconds",
                    message.age_seconds + event.publish_seconds,
                )
        self._maybe_sample()

    def sample(self) -> Stats | None:
        """Query the backlog now and set the gauges."""
        if self.store is None:
            return None
        try:
            stats = self.store.stats()
        except Exception as exc:  # a metrics sample must never stop the relay
            logger.warning("backlog sample failed: %s", exc)
            return None
        self.sink.gauge("pending", stats.pending)
        self.sink.gauge("due", stats.due)
        self.sink.gauge("dead", stats.dead)
        self.sink.gauge("scheduled", stats.scheduled)
        self.sink.gauge("oldest_pending_seconds", stats.oldest_pending_seconds or 0.0)
        self.sink.gauge("blocked_keys", stats.blocked)
        return stats

    def _maybe_sample(self) -> None:
        now = self.clock()
        if self._sampled_at is None or now - self._sampled_at >= self.sample_every:
            self._sampled_at = now
            self.sample()
