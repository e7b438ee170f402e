"""Wiring: build a relay from settings, the app and its broker."""

from __future__ import annotations

from typing import Any

from django.db import connections

from ..app import resolve_app
from ..broker import Publisher, build_publisher
from ..conf import OutboxSettings
from ..enqueue import outbox_alias
from ..exceptions import OutboxConfigurationError
from ..metrics import PrometheusSink, RelayMetrics, StatsdSink
from ..signals import send_relay_signals
from ..store import OutboxStore
from ..store.notify import PgNotifyListener
from .config import RelayConfig
from .events import Listener, log_event
from .loop import Relay


def build_relay(
    settings: OutboxSettings,
    *,
    publisher: Publisher | None = None,
    metrics_port: int | None = None,
    **overrides: Any,
) -> Relay:
    """A relay for the configured app and outbox alias; fails early on bad configuration.

    Listeners: logging, Django signals, and metrics when StatsD is configured or a
    Prometheus port is given (``/metrics`` served on that port).
    """
    config = RelayConfig.from_settings(settings, **overrides)
    alias = outbox_alias(settings)
    store = OutboxStore(alias)
    store.dialect  # noqa: B018 - refuses an unsupported database before the loop starts
    connections[alias].ensure_connection()
    if publisher is None:
        publisher = build_publisher(resolve_app(settings), settings)
    wakeup = None
    if settings.notify and connections[alias].vendor == "postgresql":
        wakeup = PgNotifyListener(alias)
    listeners: list[Listener] = [log_event, send_relay_signals]
    if settings.statsd_address:
        listeners.append(RelayMetrics(StatsdSink(settings.statsd_address), store))
    if metrics_port is not None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise OutboxConfigurationError(
                "--metrics-port needs prometheus_client: pip install 'celery-outbox[prometheus]'."
            ) from exc
        prometheus_client.start_http_server(metrics_port)
        listeners.append(RelayMetrics(PrometheusSink(), store))
    return Relay(store, publisher, config, wakeup=wakeup, listeners=listeners)
