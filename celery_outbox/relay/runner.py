"""Wiring: build a relay from settings, the app and its broker."""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db import connections

from ..app import resolve_app
from ..broker import Publisher, broker_driver, build_publisher
from ..conf import OutboxSettings
from ..contrib import library_in_use
from ..contrib.logcontext import LogContextListener, structlog_available
from ..enqueue import outbox_alias
from ..exceptions import OutboxConfigurationError
from ..metrics import PrometheusSink, RelayMetrics, StatsdSink
from ..signals import send_relay_signals
from ..store import OutboxStore
from .config import RelayConfig
from .events import Listener, TracingHook, log_event
from .heartbeat import Heartbeat, new_relay_id
from .listener import PgNotifyListener
from .loop import Relay
from .waiter import Waiter


def build_relay(
    settings: OutboxSettings,
    *,
    publisher: Publisher | None = None,
    metrics_port: int | None = None,
    **overrides: Any,
) -> Relay:
    """A relay for the configured app and outbox alias; fails early on bad configuration.

    Listeners: logging, Django signals, and metrics when StatsD is configured or a
    Prometheus port is given (``/metrics`` served on that port). Tracing (Sentry,
    OpenTelemetry) and per-message log lines in the enqueue-time structlog context are
    added when those libraries are set up in this process.
    """
    config = RelayConfig.from_settings(settings, **overrides)
    alias = outbox_alias(settings)
    store = OutboxStore(alias, holder=new_relay_id())
    store.dialect  # noqa: B018 - refuses an unsupported database before the loop starts
    store.ping()  # a clear error now if the database or the outbox tables are missing
    broker = ""
    if publisher is None:
        app = resolve_app(settings)
        broker = broker_driver(app)
        # Flags such as --send-timeout also bound connecting and socket reads.
        publisher = build_publisher(
            app, dataclasses.replace(settings, send_timeout=config.send_timeout)
        )
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
    batch_hooks = tracing_hooks(broker or type(publisher).__name__)
    listeners.extend(batch_hooks)
    if settings.log_context and structlog_available():
        listeners.append(LogContextListener())
    waiter = Waiter()
    # Rows taken over from a dead relay are due now: the loop claims them at once.
    heartbeat = Heartbeat(store, config.heartbeat_interval, on_takeover=waiter.wake)
    return Relay(
        store,
        publisher,
        config,
        waiter=waiter,
        wakeup=wakeup,
        listeners=listeners,
        batch_hooks=batch_hooks,
        heartbeat=heartbeat,
    )


def tracing_hooks(broker: str) -> list[TracingHook]:
    """Batch hooks (also listeners) for the tracing libraries this process has set up.

    Sentry when ``sentry_sdk.init`` was called; OpenTelemetry when a TracerProvider
    is installed. A library the application never imported is never imported here.
    """
    hooks: list[TracingHook] = []
    if library_in_use("sentry_sdk"):
        from ..contrib.sentry import SentryRelayTracing, sentry_initialised

        if sentry_initialised():
            hooks.append(SentryRelayTracing(broker))
    if library_in_use("opentelemetry.trace"):
        from ..contrib.otel import OtelRelayTracing, tracer_provider_configured

        if tracer_provider_configured():
            hooks.append(OtelRelayTracing(broker))
    return hooks
