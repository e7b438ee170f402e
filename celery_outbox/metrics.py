"""Relay metrics for Prometheus (optional ``prometheus_client``) and StatsD (plain UDP).

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

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .conf import OutboxSettings, split_address
from .exceptions import OutboxConfigurationError
from .outcomes import Outcome
from .relay.observations import BatchSettled, BreakerOpened, Coalesced, RelayObservation
from .store import OperatorStore, Stats

logger = logging.getLogger("celery_outbox.metrics")

PREFIX = "celery_outbox_"

#: The relay's counters, reported at 0 when its metrics start.
RELAY_COUNTERS = (
    "published_total",
    "failed_total",
    "dead_lettered_total",
    "outages_total",
    "coalesced_total",
    "blocked_total",
)


class Sink(Protocol):
    """Where metric values go."""

    def count(self, name: str, value: float) -> None:
        """Add to a counter."""
        ...

    def gauge(self, name: str, value: float) -> None:
        """Set a gauge."""
        ...

    def observe(self, name: str, value: float) -> None:
        """Record one observation of a histogram/timer."""
        ...


#: How often the StatsD host name is looked up again (a Service's address may move).
RESOLVE_EVERY = 60.0
#: How often while it could not be resolved at all (its datagrams are dropped).
RETRY_UNRESOLVED = 5.0

#: ``socket.getaddrinfo``'s shape: (host, port, family, type) -> address infos.
Resolver = Callable[..., Any]


class StatsdSink:
    """Fire-and-forget StatsD over UDP; a lost datagram never slows the relay.

    The host name is resolved when the sink is built and again every
    :data:`RESOLVE_EVERY` seconds, never per datagram: a relay sends several per
    batch, and a name such as ``statsd.monitoring.svc`` would cost a DNS query each.
    The later lookups run on a thread of their own, so a slow DNS server never holds
    up the relay; datagrams go to the last good address meanwhile.
    """

    def __init__(
        self,
        address: str,
        *,
        resolve: Resolver = socket.getaddrinfo,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            host, port = split_address(address)
        except ValueError as exc:
            raise ValueError(
                f"StatsD address must look like 'host:8125': {exc}"
            ) from None
        self._host, self._port = host, port
        self._resolve = resolve
        self._clock = clock
        found = self._lookup()
        if found is None:
            logger.warning(
                "StatsD host %r not resolved at start; its metrics are dropped until "
                "it is (tried again every %g s)",
                host,
                RETRY_UNRESOLVED,
            )
        self._family = _family(found or [])
        self._socket = socket.socket(self._family, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._address = _address_of(found or [], self._family)
        self._resolved_at = clock()
        self._refreshing: threading.Thread | None = None

    def _lookup(self) -> list[Any] | None:
        try:
            return list(self._resolve(self._host, self._port, 0, socket.SOCK_DGRAM))
        except OSError as exc:
            logger.debug("StatsD host %r not resolved: %s", self._host, exc)
            return None

    def close(self) -> None:
        """Release the socket."""
        self._socket.close()

    def _refresh(self) -> None:
        found = _address_of(self._lookup() or [], self._family)
        if found is not None:  # else keep the last good one
            self._address = found

    def refreshed(self, timeout: float) -> bool:
        """Wait for a lookup under way, if any; whether none is left running."""
        refreshing = self._refreshing
        if refreshing is not None:
            refreshing.join(timeout)
            return not refreshing.is_alive()
        return True

    def _send(self, line: str) -> None:
        now = self._clock()
        every = RESOLVE_EVERY if self._address is not None else RETRY_UNRESOLVED
        if now - self._resolved_at >= every and self.refreshed(0):
            self._resolved_at = now
            self._refreshing = threading.Thread(
                target=self._refresh, name="celery-outbox-statsd-dns", daemon=True
            )
            self._refreshing.start()
        address = self._address
        if address is None:
            return
        with contextlib.suppress(OSError):
            self._socket.sendto(line.encode(), address)

    def count(self, name: str, value: float) -> None:
        """``name:value|c``."""
        self._send(f"{PREFIX}{name}:{value:g}|c")

    def gauge(self, name: str, value: float) -> None:
        """``name:value|g``."""
        self._send(f"{PREFIX}{name}:{value:g}|g")

    def observe(self, name: str, value: float) -> None:
        """Timers in milliseconds: ``name:ms|ms``."""
        self._send(f"{PREFIX}{name}:{value * 1000:.3f}|ms")


def _family(infos: list[Any]) -> int:
    """IPv4 whenever the host has an IPv4 address; IPv6 for a host with only IPv6.

    A socket of the wrong family drops every datagram without a word.
    """
    found = {info[0] for info in infos}
    if socket.AF_INET6 in found and socket.AF_INET not in found:
        return socket.AF_INET6
    return socket.AF_INET


def _address_of(infos: list[Any], family: int) -> Any:
    """The first socket address of ``family`` among ``getaddrinfo``'s answers, or None."""
    for info in infos:
        if info[0] == family:
            return info[4]
    return None


class PrometheusSink:
    """prometheus_client metrics in a registry (the default one unless given)."""

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client as prom

        self.registry = registry or prom.REGISTRY
        self._metrics: dict[str, Any] = {}
        self._prom = prom

    def _get(self, kind: str, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            factory = {
                "counter": self._prom.Counter,
                "gauge": self._prom.Gauge,
                "histogram": self._prom.Histogram,
            }[kind]
            base = name.removesuffix("_total") if kind == "counter" else name
            metric = factory(
                PREFIX + base, f"celery-outbox {name}", registry=self.registry
            )
            self._metrics[name] = metric
        return metric

    def count(self, name: str, value: float) -> None:
        """Increment a counter."""
        self._get("counter", name).inc(value)

    def gauge(self, name: str, value: float) -> None:
        """Set a gauge."""
        self._get("gauge", name).set(value)

    def observe(self, name: str, value: float) -> None:
        """Observe a histogram."""
        self._get("histogram", name).observe(value)


def configured_sinks(settings: OutboxSettings, metrics_port: int | None) -> list[Sink]:
    """The sinks a relay or handler processor reports to: StatsD when
    ``CELERY_OUTBOX_STATSD_ADDRESS`` is set, and Prometheus served on ``metrics_port``
    (``/metrics``) when a port is given."""
    sinks: list[Sink] = []
    if settings.statsd_address:
        sinks.append(StatsdSink(settings.statsd_address))
    if metrics_port is not None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise OutboxConfigurationError(
                "--metrics-port needs prometheus_client: "
                "pip install 'celery-outbox[prometheus]'."
            ) from exc
        prometheus_client.start_http_server(metrics_port)
        sinks.append(PrometheusSink())
    return sinks


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
