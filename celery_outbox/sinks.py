"""Where metrics go: StatsD (plain UDP) and Prometheus (optional ``prometheus_client``).

A :class:`Sink` takes counters, gauges and histograms; the relay's and the handler
processor's observers (:class:`celery_outbox.metrics.RelayMetrics`,
:class:`celery_outbox.handlers.metrics.HandlerMetrics`) report to the sinks
:func:`configured_sinks` builds. Every name is prefixed ``celery_outbox_``.
``prometheus_client`` is imported only when a Prometheus sink is built.
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

logger = logging.getLogger("celery_outbox.metrics")

PREFIX = "celery_outbox_"


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
