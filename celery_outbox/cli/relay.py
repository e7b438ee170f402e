"""``outbox relay`` and ``outbox health``: the process that publishes, and its probe."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from django.core.management.base import CommandError

from ..conf import get_settings
from ..exceptions import OutboxConfigurationError, OutboxError
from .options import Streams, positive

logger = logging.getLogger("celery_outbox.relay")

#: The relay's flags that override a setting of the same name.
_OVERRIDES = (
    "until_empty",
    "batch_size",
    "lease_seconds",
    "poll_interval",
    "send_timeout",
    "shutdown_timeout",
    "max_attempts",
    "retry_base_seconds",
    "retry_max_seconds",
    "broker_outage_cooldown",
    "liveness_file",
)


def add_relay(parser: argparse.ArgumentParser) -> None:
    """``relay``'s flags: each overrides its setting for this process."""
    parser.add_argument(
        "--until-empty",
        action="store_true",
        help="Exit once no row is due, or at the first outage: 0 when nothing it "
        "could send is left; 1 naming the rows left unsent (a broker outage, a "
        "refusal waiting for its retry) or the database that did not answer; 3 "
        "when only rows a limit holds back (a flow, an ordered key) are left.",
    )
    for flag, kind, metavar in (
        ("--batch-size", int, "N"),
        ("--lease-seconds", float, "SECONDS"),
        ("--poll-interval", float, "SECONDS"),
        ("--send-timeout", float, "SECONDS"),
        ("--shutdown-timeout", float, "SECONDS"),
        ("--max-attempts", int, "N"),
        ("--retry-base-seconds", float, "SECONDS"),
        ("--retry-max-seconds", float, "SECONDS"),
        ("--broker-outage-cooldown", float, "SECONDS"),
    ):
        parser.add_argument(flag, type=positive(kind), default=None, metavar=metavar)
    parser.add_argument(
        "--liveness-file",
        default=None,
        metavar="PATH",
        help="Touched while the loop is healthy.",
    )
    parser.add_argument(
        "--metrics-port",
        type=positive(int),
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics on this port (needs prometheus_client).",
    )
    parser.set_defaults(run=run_relay)


def run_relay(options: dict[str, Any], streams: Streams) -> None:
    """Run the relay until a signal (or until empty)."""
    from .exits import ExitStatus, exit_status
    from .runner import build_relay

    overrides = {name: options[name] for name in _OVERRIDES}
    overrides["until_empty"] = overrides["until_empty"] or None
    relay = build_relay(
        get_settings(), metrics_port=options["metrics_port"], **overrides
    )

    def on_signal(signum: int, _frame: Any) -> None:
        relay.stop()

    previous = {
        sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        reason = relay.run()
        logger.info("relay stopped: %s", reason.value)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = exit_status(reason)
    if status is not ExitStatus.OK:
        raise CommandError(
            f"relay stopped: {reason.value}: {relay.loop.left.describe()}",
            returncode=status,
        )


def run_health(options: dict[str, Any], streams: Streams) -> None:
    """Exit non-zero with a reason when the database or the broker is unreachable."""
    from ..app import resolve_app
    from ..broker import build_publisher
    from ..broker.base import explain
    from ..relay.probe import broker_location
    from ..store import outbox_stores

    settings = get_settings()
    stores = outbox_stores(settings)
    alias = stores.alias
    problems = []
    try:
        stores.relay().ping()
    except OutboxConfigurationError as exc:  # reachable, but the tables are missing
        problems.append(str(exc))
    except OutboxError as exc:
        problems.append(f"database {alias!r} unreachable: {exc}")
    app = resolve_app(settings)
    where = broker_location(app)
    publisher = build_publisher(app, settings)
    node = None
    try:
        node = publisher.ping()
    except Exception as exc:
        problems.append(f"broker {where} unreachable: {explain(exc)}")
    finally:
        publisher.close()
    if problems:
        raise CommandError("unhealthy: " + "; ".join(problems))
    broker = node or where
    if node and ";" in where:  # a failover list: which node answered
        broker = f"node {node} (of {where})"
    streams.line(f"ok: database {alias!r} and broker {broker} reachable")
