"""``python manage.py outbox <subcommand>``: thin wrappers that parse, configure and call."""

from __future__ import annotations

import argparse
import logging
import math
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...conf import get_settings
from ...exceptions import OutboxConfigurationError, OutboxError
from ..errors import command_error

logger = logging.getLogger("celery_outbox.relay")


class Command(BaseCommand):
    help = "celery-outbox: run the relay and inspect the outbox."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(
            dest="subcommand",
            required=True,
            metavar="{relay,health,stats,inspect,replay,purge,events,handlers,handler-stats,handler-replay,pause,resume}",
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
        _add_operator_arguments(sub, stats, kwargs)
        inspect = sub.add_parser(
            "inspect",
            help="Say where a message is (waiting, in flight, retrying, dead, "
            "published), with its history; exit 1 for an unknown task id.",
            **kwargs,
        )
        inspect.add_argument("task_id", help="The task id (AsyncResult.id).")
        inspect.add_argument("--format", choices=["text", "json"], default="text")
        from ...events.commands import add_arguments as add_events_arguments

        add_events_arguments(
            sub.add_parser("events", help="Events: topology and archive.", **kwargs),
            **kwargs,
        )
        from ...handlers import cli as handlers_cli

        handlers_cli.add_parsers(sub, kwargs, _positive)

    def handle(self, *args: Any, **options: Any) -> None:
        from ...handlers import cli as handlers_cli

        try:
            if options["subcommand"] in handlers_cli.SUBCOMMANDS:
                handlers_cli.handle(options, self.stdout.write)
                return
            handler = {
                "relay": self._relay,
                "stats": self._stats,
                "inspect": self._inspect,
                "health": self._health,
                "replay": self._replay,
                "purge": self._purge,
                "events": self._events,
            }
            handler[options["subcommand"]](options)
        except OutboxError as exc:
            raise command_error(exc) from exc

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
            reason = relay.run()
            logger.info("relay stopped: %s", reason.value)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _events(self, options: dict[str, Any]) -> None:
        from ...events.commands import run

        run(options, self.stdout)

    def _health(self, options: dict[str, Any]) -> None:
        from ...app import resolve_app
        from ...broker import build_publisher, describe
        from ...store import outbox_stores

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
        from ...operations import StatsRequest, watch
        from ...store import outbox_stores

        request = StatsRequest(
            format=options["format"],
            top=options["top"],
            interval=options["watch"],
            iterations=options["iterations"],
        )
        watch(outbox_stores().operator(), request, self.stdout.write)

    def _inspect(self, options: dict[str, Any]) -> None:
        from ...inspection import InspectRequest, inspect_message
        from ...store import outbox_stores

        request = InspectRequest.parse(
            task_id=options["task_id"], format=options["format"]
        )
        trace = outbox_stores().history_log().trace(request.task_id)
        self.stdout.write(inspect_message(trace, request))

    def _replay(self, options: dict[str, Any]) -> None:
        from ...operations import ReplayRequest, replay
        from ...store import outbox_stores

        request = ReplayRequest.parse(
            ids=options["ids"],
            task=options["task"],
            since=options["since"],
            until=options["until"],
            everything=options["all"],
            dry_run=options["dry_run"],
            chunk_size=options["chunk_size"],
        )
        self.stdout.write(replay(outbox_stores().operator(), request, self.stderr))

    def _purge(self, options: dict[str, Any]) -> None:
        from ...operations import PurgeRequest, purge
        from ...store import outbox_stores

        request = PurgeRequest.parse(
            older_than=options["older_than"],
            retention=get_settings().dead_letter_retention,
            task=options["task"],
            dry_run=options["dry_run"],
            chunk_size=options["chunk_size"],
            everything=options["all"],
        )
        self.stdout.write(purge(outbox_stores().operator(), request))


def _add_operator_arguments(
    sub: Any, stats: CommandParser, kwargs: dict[str, Any]
) -> None:
    """Arguments of ``stats``, ``replay`` and ``purge``."""
    stats.add_argument(
        "--format", choices=["text", "json", "prometheus"], default="text"
    )
    stats.add_argument(
        "--top",
        type=_positive(int),
        default=None,
        metavar="N",
        help="Also list the N task names that fail most (retrying and dead).",
    )
    stats.add_argument(
        "--watch",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="Print again every SECONDS until Ctrl-C.",
    )
    stats.add_argument(
        "--iterations", type=_positive(int), default=None, help=argparse.SUPPRESS
    )
    replay = sub.add_parser(
        "replay",
        help="Put dead letters back into the outbox (same message, attempts reset, due now).",
        **kwargs,
    )
    replay.add_argument(
        "ids", nargs="*", help="Dead-letter ids (the admin shows them)."
    )
    replay.add_argument(
        "--task", default=None, metavar="GLOB", help="Task name or glob."
    )
    replay.add_argument(
        "--since",
        default=None,
        help="Died at or after: ISO datetime or 2h, 30m, 7d ago.",
    )
    replay.add_argument(
        "--until", default=None, help="Died before: ISO datetime or 2h, 30m, 7d ago."
    )
    replay.add_argument(
        "--all", action="store_true", help="Replay every dead letter (no filter)."
    )
    replay.add_argument(
        "--dry-run", action="store_true", help="Only say what would happen."
    )
    replay.add_argument("--chunk-size", type=_positive(int), default=500)
    purge = sub.add_parser(
        "purge", help="Delete old dead letters, in chunks.", **kwargs
    )
    purge.add_argument(
        "--older-than",
        default=None,
        metavar="DURATION",
        help="Dead for longer than this (7d, 12h, seconds); default: "
        "CELERY_OUTBOX_DEAD_LETTER_RETENTION.",
    )
    purge.add_argument(
        "--task", default=None, metavar="GLOB", help="Task name or glob."
    )
    purge.add_argument(
        "--all", action="store_true", help="Delete every dead letter, whatever its age."
    )
    purge.add_argument("--dry-run", action="store_true", help="Only count.")
    purge.add_argument("--chunk-size", type=_positive(int), default=1000)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {kind.__name__}"
            ) from None
        if not value > 0 or not math.isfinite(value):  # nan compares false
            raise argparse.ArgumentTypeError(
                f"must be a positive, finite number, got {text}"
            )
        return value

    return parse


__all__ = ["Command", "OutboxConfigurationError"]
