"""Handler processor metrics, through the relay's sinks (StatsD, Prometheus).

The names, prefixed ``celery_outbox_`` as the relay's:

====================================  =========  ===========================================
name                                  kind       meaning
====================================  =========  ===========================================
handler_processed_total               counter    messages whose receiver succeeded
handler_retried_total                 counter    receiver failures that will be retried
handler_dead_lettered_total           counter    messages moved to the handler dead letters
handler_coalesced_total               counter    messages deleted unrun for a newer one
handler_run_seconds                   histogram  a receiver's run and its settlement
handler_commit_to_done_seconds        histogram  message written to receiver succeeded
handler_messages                      gauge      messages waiting (sampled)
handler_shards_waiting                gauge      shards due now that no processor holds
handler_shards_blocked                gauge      shards whose head is failing
handler_shards_paused                 gauge      shards stopped by a pause
handler_dead                          gauge      handler dead letters
handler_oldest_seconds                gauge      age of the oldest waiting message
handler_lag_seconds                   gauge      age of the oldest message neither blocked
                                                 nor paused (the processing lag)
====================================  =========  ===========================================

Gauges are sampled every ``sample_every`` seconds, after a processor's pass, and sum
(counts) or take the largest value (ages) over the processor's databases. The
counters exist from the processor's start, at 0 (as the relay's).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from ..conf import OutboxSettings
from ..outcomes import Action
from ..sinks import Sink
from ..store.handlers import HandlerStats
from ..store.handlers.sql import HandlerStore
from .observations import (
    HandlerObservation,
    HandlerObserver,
    MessageHandled,
    MessagesCoalesced,
    PassDone,
)

logger = logging.getLogger("celery_outbox.handlers")

_COUNTERS = {
    Action.DELETE: "handler_processed_total",
    Action.RETRY: "handler_retried_total",
    Action.DEAD_LETTER: "handler_dead_lettered_total",
}
#: The processor's counters, reported at 0 when its metrics start.
HANDLER_COUNTERS = (*_COUNTERS.values(), "handler_coalesced_total")


class HandlerMetrics:
    """A processor observer that turns its observations into metrics and samples the backlog."""

    def __init__(
        self,
        sink: Sink,
        databases: Sequence[str] = (),
        *,
        sample_every: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        stats: Callable[[str], HandlerStats] | None = None,
    ) -> None:
        self.sink = sink
        self.databases = tuple(databases)
        self.sample_every = sample_every
        self.clock = clock
        self._stats = stats or (lambda alias: HandlerStore(alias).stats(top=1))
        self._sampled_at: float | None = None
        for name in HANDLER_COUNTERS:
            sink.count(name, 0)

    def __call__(self, event: HandlerObservation) -> None:
        """Record one processor observation (the others are ignored)."""
        if isinstance(event, MessageHandled):
            self.sink.count(_COUNTERS[event.action], 1)
            self.sink.observe("handler_run_seconds", event.seconds)
            if event.action is Action.DELETE and event.age_seconds is not None:
                self.sink.observe("handler_commit_to_done_seconds", event.age_seconds)
        elif isinstance(event, MessagesCoalesced):
            self.sink.count("handler_coalesced_total", sum(event.counts.values()))
        elif isinstance(event, PassDone):
            self._maybe_sample()

    def close(self) -> None:
        """Release the sink's socket, if it holds one (StatsD)."""
        close = getattr(self.sink, "close", None)
        if callable(close):
            close()

    def sample(self) -> list[HandlerStats]:
        """Query every database's backlog now and set the gauges."""
        reports: list[HandlerStats] = []
        for alias in self.databases:
            try:
                reports.append(self._stats(alias))
            except Exception as exc:  # a sample must never stop the processor
                logger.warning("handler backlog sample on %r failed: %s", alias, exc)
        if not reports:
            return reports
        gauge = self.sink.gauge
        gauge("handler_messages", sum(r.messages for r in reports))
        gauge("handler_shards_waiting", sum(r.waiting for r in reports))
        gauge("handler_shards_blocked", sum(r.blocked for r in reports))
        gauge("handler_shards_paused", sum(r.paused_shards for r in reports))
        gauge("handler_dead", sum(r.dead_letters for r in reports))
        gauge("handler_oldest_seconds", _largest(r.oldest_age for r in reports))
        gauge("handler_lag_seconds", _largest(r.lag for r in reports))
        return reports

    def _maybe_sample(self) -> None:
        now = self.clock()
        if self._sampled_at is None or now - self._sampled_at >= self.sample_every:
            self._sampled_at = now
            self.sample()


def _largest(values: Iterable[float | None]) -> float:
    return max((v for v in values if v is not None), default=0.0)


def processor_observers(
    settings: OutboxSettings, databases: Sequence[str], metrics_port: int | None = None
) -> list[HandlerMetrics]:
    """The metrics observers a processor gets: StatsD when configured, Prometheus on a port."""
    from ..sinks import configured_sinks

    return [
        HandlerMetrics(sink, databases)
        for sink in configured_sinks(settings, metrics_port)
    ]


def flush_observers(settings: OutboxSettings) -> list[HandlerObserver]:
    """Counters for flushes in a writing process: StatsD only, one sink per process."""
    if not settings.statsd_address:
        return []
    return [_statsd_counters(settings.statsd_address)]


@functools.lru_cache(maxsize=4)
def _statsd_counters(address: str) -> HandlerObserver:
    from ..sinks import StatsdSink

    # No databases: a flush never samples the backlog (the processor does).
    return HandlerMetrics(StatsdSink(address))
