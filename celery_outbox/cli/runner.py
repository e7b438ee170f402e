"""The relay process as ``outbox relay`` runs it: the relay lane, its app and its observers.

The composition root of the relay: it resolves the app, builds the publisher, and
hands the lane (:class:`~celery_outbox.relay.loop.Relay`) its observers: logging,
Django signals, metrics, Sentry and OpenTelemetry, the structlog context. The lane
imports none of them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from django.db import connections

from ..app import resolve_app
from ..broker import Publisher, broker_driver, build_publisher
from ..broker.base import queue_depth
from ..conf import OutboxSettings
from ..contrib import library_in_use
from ..contrib.logcontext import bound_log_context, structlog_available
from ..engine.heartbeat import Heartbeat, new_member_id
from ..engine.waiter import Waiter
from ..exceptions import OutboxDatabaseError
from ..flow.gate import gate_for, reconcile
from ..metrics import RelayMetrics
from ..relay.config import RelayConfig
from ..relay.listener import PgNotifyListener
from ..relay.logs import FailureLog
from ..relay.loop import Relay
from ..relay.observations import Observer, TracingHook, log_observation
from ..relay.probe import broker_location, probe_broker, probe_database
from ..relay.sent import sent_event_observers
from ..signals import send_relay_signals
from ..sinks import configured_sinks
from ..store import outbox_stores

logger = logging.getLogger("celery_outbox.relay")


def build_relay(
    settings: OutboxSettings,
    *,
    publisher: Publisher | None = None,
    metrics_port: int | None = None,
    **overrides: Any,
) -> Relay:
    """A relay for the configured app and outbox alias; fails early on bad configuration.

    Probes the outbox database and the broker once and logs where they are
    (:mod:`.probe`). Listeners: logging (a rate-limited line per retry and dead
    letter, :mod:`.logs`), Django signals, Celery's ``task-sent`` event when the app
    has ``task_send_sent_event`` on (:mod:`.sent`), and metrics when StatsD is
    configured or a Prometheus port is given (``/metrics`` served on that port). Tracing (Sentry,
    OpenTelemetry) and the enqueue-time structlog context around the per-message lines
    are added when those libraries are set up in this process.
    """
    config = RelayConfig.from_settings(settings, **overrides)
    stores = outbox_stores(settings, holder=new_member_id())
    store = stores.relay()
    # Where the relay connects, logged once. A broker that is down is an outage like
    # any other; a database that is down or lacks the tables stops the relay here.
    database = probe_database(store)
    broker = ""
    sent_events: list[Observer] = []
    if publisher is None:
        app = resolve_app(settings)
        # Celery's task-sent event, when the app asks for it (task_send_sent_event).
        sent_events = sent_event_observers(app)
        broker = broker_driver(app)
        where = broker_location(app)
        # Flags such as --send-timeout also bound connecting and socket reads.
        publisher = build_publisher(
            app, dataclasses.replace(settings, send_timeout=config.send_timeout)
        )
    else:
        where = type(publisher).__name__
    probe_broker(publisher, where)
    if database.failure is not None:
        publisher.close()
        raise database.failure
    # What a flow parked or held under settings that changed is released now, not
    # at its lease. A database that fails this one statement does not stop the
    # relay: those rows wait for their lease, as they did before reconciling.
    try:
        reconcile(settings.flows, stores.flows())
    except OutboxDatabaseError as exc:
        stores.flows().reset_connection()
        logger.warning(
            "cannot release the rows of changed flows at start (%s): they are due "
            "at their lease",
            exc,
        )
    wakeup = None
    if settings.notify and connections[stores.alias].vendor == "postgresql":
        wakeup = PgNotifyListener(stores.alias)
    observers: list[Observer] = [log_observation, send_relay_signals, *sent_events]
    observers.extend(
        RelayMetrics(sink, stores.operator())
        for sink in configured_sinks(settings, metrics_port)
    )
    batch_hooks = tracing_hooks(broker or type(publisher).__name__)
    observers.extend(batch_hooks)
    # Retries and dead letters, rate-limited; in each message's enqueue-time structlog
    # context when that is on.
    if settings.log_context and structlog_available():
        observers.append(FailureLog(context=bound_log_context))
    else:
        observers.append(FailureLog())
    waiter = Waiter()
    # Rows taken over from a dead relay are due now: the loop claims them at once.
    heartbeat = Heartbeat(
        stores.registry(),
        config.heartbeat_interval,
        on_takeover=waiter.wake,
    )
    return Relay(
        store,
        publisher,
        config,
        waiter=waiter,
        wakeup=wakeup,
        observers=observers,
        batch_hooks=batch_hooks,
        heartbeat=heartbeat,
        gate=gate_for(settings, stores.flows(), queue_depth(publisher)),
    )


def tracing_hooks(broker: str) -> list[TracingHook]:
    """Batch hooks (also observers) for the tracing libraries this process has set up.

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
