"""``python manage.py outbox <subcommand>``: thin wrappers that parse, configure and call."""

from __future__ import annotations

import argparse
import json
import logging
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...conf import get_settings
from ...exceptions import OutboxConfigurationError, OutboxError

logger = logging.getLogger("celery_outbox.relay")


class Command(BaseCommand):
    help = "celery-outbox: run the relay and inspect the outbox."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(
            dest="subcommand", required=True, metavar="{relay,stats}"
        )
        kwargs: dict[str, Any] = {"called_from_command_line": True}
        relay = sub.add_parser(
            "relay", help="Publish committed rows to the broker.", **kwargs
        )
        relay.add_argument(
            "--until-empty", action="store_true", help="Exit 0 once no row is due."
        )
        relay.add_argument("--batch-size", type=_positive(int), default=None)
        relay.add_argument("--lease-seconds", type=_positive(float), default=None)
        relay.add_argument("--poll-interval", type=_positive(float), default=None)
        relay.add_argument("--send-timeout", type=_positive(float), default=None)
        relay.add_argument("--shutdown-timeout", type=_positive(float), default=None)
        relay.add_argument("--max-attempts", type=_positive(int), default=None)
        relay.add_argument("--retry-base-seconds", type=_positive(float), default=None)
        relay.add_argument("--retry-max-seconds", type=_positive(float), default=None)
        relay.add_argument(
            "--broker-outage-cooldown", type=_positive(float), default=None
        )
        relay.add_argument(
            "--liveness-file", default=None, help="Touched while the loop is healthy."
        )
        relay.add_argument(
            "--metrics-port",
            type=_positive(int),
            default=None,
            help="Serve Prometheus metrics on this port (needs prometheus_client).",
        )
        sub.add_parser(
            "health",
            help="Exit non-zero with a reason when the database or the broker is unreachable.",
            **kwargs,
        )
        stats = sub.add_parser("stats", help="Print the outbox backlog.", **kwargs)
        stats.add_argument("--format", choices=["text", "json"], default="text")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            handler = {
                "relay": self._relay,
                "stats": self._stats,
                "health": self._health,
            }
            handler[options["subcommand"]](options)
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc

    def _relay(self, options: dict[str, Any]) -> None:
        from ...relay.runner import build_relay

        names = (
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
        overrides = {name: options[name] for name in names}
        overrides["until_empty"] = overrides["until_empty"] or None
        relay = build_relay(
            get_settings(), metrics_port=options["metrics_port"], **overrides
        )

        def on_signal(signum: int, _frame: Any) -> None:
            relay.stop()

        previous = {
            sig: signal.signal(sig, on_signal)
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            logger.info("relay started (database %r)", relay.store.alias)
            reason = relay.run()
            logger.info("relay stopped: %s", reason.value)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _health(self, options: dict[str, Any]) -> None:
        from ...app import resolve_app
        from ...broker import build_publisher, describe
        from ...enqueue import outbox_alias
        from ...store import OutboxStore

        settings = get_settings()
        alias = outbox_alias(settings)
        problems = []
        try:
            OutboxStore(alias).ping()
        except OutboxError as exc:
            problems.append(f"database {alias!r} unreachable: {exc}")
        app = resolve_app(settings)
        publisher = build_publisher(app, settings)
        try:
            publisher.ping()
        except Exception as exc:
            problems.append(f"broker unreachable: {describe(exc)}")
        finally:
            publisher.close()
        if problems:
            raise CommandError("unhealthy: " + "; ".join(problems))
        broker = app.connection_for_write().as_uri()
        self.stdout.write(f"ok: database {alias!r} and broker {broker} reachable")

    def _stats(self, options: dict[str, Any]) -> None:
        from ...enqueue import outbox_alias
        from ...store import OutboxStore

        stats = OutboxStore(outbox_alias(get_settings())).stats()
        if options["format"] == "json":
            self.stdout.write(json.dumps(stats.as_dict()))
            return
        oldest = stats.oldest_pending_seconds
        lines = [
            f"pending   {stats.pending}",
            f"due       {stats.due}",
            f"in flight {stats.in_flight}",
            f"dead      {stats.dead}",
            f"oldest    {'-' if oldest is None else f'{oldest:.1f} s'}",
        ]
        self.stdout.write("\n".join(lines))


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {kind.__name__}"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


__all__ = ["Command", "OutboxConfigurationError"]
