"""``outbox handlers <verb>``: the handler outboxes (``emit()`` to ``@receiver``s).

Flags only: the work is in :mod:`celery_outbox.handlers.cli`.
"""

from __future__ import annotations

import argparse
from fnmatch import fnmatchcase
from typing import Any

from django.core.management.base import CommandError

from .options import Streams, add_databases, add_format, add_top, positive
from .selectors import Selection, add_selectors, is_glob

HELP = "Handler outboxes: run their receivers, their backlog, dead letters, pauses."


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> Any:
    """Add ``handlers``'s verbs to its parser."""
    verbs = lane.add_subparsers(dest="verb", metavar="VERB")
    run = verbs.add_parser(
        "run", help="Run the receivers of the handler outboxes (no broker).", **kwargs
    )
    add_run_arguments(run)
    stats = verbs.add_parser(
        "stats", help="Print the backlog, blocked and paused shards.", **kwargs
    )
    add_stats_arguments(stats)
    replay = verbs.add_parser(
        "replay", help="Write dead letters back at the end of their shards.", **kwargs
    )
    add_selectors(
        replay,
        ids="Dead-letter ids (the admin shows them).",
        name="Category (receiver name) or glob over the registered ones.",
        key="Shard key, e.g. org:42 (repeat for several).",
        everything="Every dead letter.",
    )
    add_databases(replay)
    replay.set_defaults(run=run_replay)
    for verb, text in (("pause", "Stop"), ("resume", "Restart")):
        parser = verbs.add_parser(
            verb, help=f"{text} a category or a shard, at runtime.", **kwargs
        )
        add_switch_arguments(parser, verb)
    return verbs


def add_run_arguments(parser: argparse.ArgumentParser, *, hidden: bool = False) -> None:
    """``run``'s flags (the old bare ``outbox handlers`` takes them, ``hidden``)."""

    def shown(text: str) -> str:
        return argparse.SUPPRESS if hidden else text

    parser.add_argument(
        "--until-empty", action="store_true", help=shown("Exit once no shard is due.")
    )
    parser.add_argument(
        "--lease-seconds",
        type=positive(float),
        default=None,
        metavar="SECONDS",
        help=shown(
            "How long a shard's lease lasts (CELERY_OUTBOX_HANDLER_LEASE_SECONDS)."
        ),
    )
    parser.add_argument(
        "--poll-interval",
        type=positive(float),
        default=None,
        metavar="SECONDS",
        help=shown("Longest wait between two looks for due shards."),
    )
    parser.add_argument(
        "--liveness-file",
        default=None,
        metavar="PATH",
        help=shown("Touch this file while the processor runs (a liveness probe)."),
    )
    parser.add_argument(
        "--metrics-port",
        type=positive(int),
        default=None,
        metavar="PORT",
        help=shown("Serve Prometheus metrics on this port (needs prometheus_client)."),
    )
    if hidden:
        parser.add_argument(
            "--database", action="append", default=None, help=argparse.SUPPRESS
        )
    else:
        add_databases(parser)
        parser.set_defaults(run=run_processor)


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    """``stats``'s flags."""
    add_format(parser)
    add_top(parser, "deepest and blocked shards")
    add_databases(parser)
    parser.set_defaults(run=run_stats)


def add_switch_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """``pause``'s or ``resume``'s flags: one category or one shard."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--name", default=None, help="A category (receiver name).")
    target.add_argument("--key", default=None, help="A shard key, e.g. org:42.")
    if verb == "pause":
        parser.add_argument("--reason", default="", help="Shown by stats and admin.")
    add_databases(parser)
    parser.set_defaults(run=run_switch, verb=verb)


def run_processor(options: dict[str, Any], streams: Streams) -> None:
    """Run the handler processor."""
    from ..handlers import cli

    cli.run_processor(
        selected=options["database"],
        lease_seconds=options["lease_seconds"],
        poll_interval=options["poll_interval"],
        until_empty=options["until_empty"],
        liveness_file=options["liveness_file"],
        metrics_port=options["metrics_port"],
        write=streams.line,
    )


def run_stats(options: dict[str, Any], streams: Streams) -> None:
    """Print the handler outboxes' backlog."""
    from ..handlers import cli

    databases = cli.databases(options["database"])
    cli.stats(databases, options["format"], options["top"], streams.line)


def run_replay(options: dict[str, Any], streams: Streams) -> None:
    """Write the selected dead letters back."""
    from ..handlers import cli

    selection = Selection.of(options)
    selection.require("handlers replay", "ids, --name GLOB, --key KEY")
    if len(selection.keys) > 1:
        raise CommandError("handlers replay: give one --key (one shard) at a time")
    databases = cli.databases(options["database"])
    for category in _categories(selection.name):
        cli.replay(
            databases,
            ids=list(selection.numbers("handlers replay")) or None,
            category=category,
            shard=selection.keys[0] if selection.keys else None,
            write=streams.line,
        )


def _categories(name: str | None) -> list[str | None]:
    """``--name``: itself when plain, else the registered categories it matches."""
    if name is None or not is_glob(name):
        return [name]
    from ..handlers.registry import registry

    matched = [each for each in registry.names() if fnmatchcase(each, name)]
    if not matched:
        raise CommandError(
            f"--name {name!r} matches no registered category ("
            f"{', '.join(registry.names()) or 'none registered'}); give the exact name "
            f"of one that is no longer registered"
        )
    return list(matched)


def run_switch(options: dict[str, Any], streams: Streams) -> None:
    """Pause or resume a category or a shard."""
    from ..handlers import cli

    kind, value = (
        ("category", options["name"])
        if options["name"] is not None
        else ("shard", options["key"])
    )
    if not value:
        raise CommandError(
            f"give a non-empty --{'name' if kind == 'category' else 'key'}"
        )
    cli.switch(
        options["verb"],
        cli.databases(options["database"]),
        kind=kind,
        value=value,
        reason=options.get("reason", ""),
        write=streams.line,
    )
