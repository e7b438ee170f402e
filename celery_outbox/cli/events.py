"""``outbox events <verb>``: events fanned out to services, their topology and archive.

Not ``celery events``, which monitors workers: these are the messages your services
publish to each other (:mod:`celery_outbox.events`).
"""

from __future__ import annotations

import argparse
from typing import Any

from .options import Streams, add_format, add_top, positive
from .selectors import add_selectors

HELP = (
    "Events to other services: topology, queues, the archive of failed events "
    "(not 'celery events', which monitors workers)."
)


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Add ``events``'s flags and verbs to its parser."""
    add_service_arguments(lane)
    verbs = lane.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser(
        "show", help="Print the service's exchanges and queues.", **kwargs
    ).set_defaults(run=run)
    declare = verbs.add_parser(
        "declare", help="Declare the service's topology (idempotent).", **kwargs
    )
    declare.add_argument(
        "--dry-run", action="store_true", help="Print it, declare nothing."
    )
    declare.set_defaults(run=run)
    stats = verbs.add_parser(
        "stats", help="Messages per queue: events, retries, archive.", **kwargs
    )
    add_format(stats)
    add_top(stats, "fullest queues")
    stats.set_defaults(run=run)
    inspect = verbs.add_parser("inspect", help="Print archived events.", **kwargs)
    inspect.add_argument(
        "--limit",
        type=positive(int),
        default=100,
        metavar="N",
        help="Print at most N (default: 100).",
    )
    inspect.set_defaults(run=run)
    replay = verbs.add_parser(
        "replay", help="Put archived events back into their queues.", **kwargs
    )
    add_selectors(
        replay,
        ids="Task ids of archived events ('inspect' lists them).",
        name="Event name or glob.",
        everything="Every archived event.",
    )
    replay.set_defaults(run=run)
    purge = verbs.add_parser("purge", help="Delete the archived events.", **kwargs)
    add_selectors(
        purge,
        everything="Every archived event (the archive is deleted whole).",
        dry_run="Only count.",
    )
    purge.set_defaults(run=run)


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """``--app`` and ``--service``: whose topology and archive."""
    parser.add_argument(
        "--app",
        default=None,
        metavar="DOTTED_PATH",
        help="The service's app (default: CELERY_OUTBOX_APP or the only one).",
    )
    parser.add_argument(
        "--service",
        default=None,
        metavar="NAME",
        help="Act on this service's archive (default: the app's name).",
    )


def run(options: dict[str, Any], streams: Streams) -> None:
    """Run the verb (the work is in :mod:`celery_outbox.events.commands`)."""
    from django.utils.module_loading import import_string

    from ..app import resolve_app
    from ..events.commands import run as run_events

    path = options.get("app")
    app = import_string(path) if path is not None else resolve_app()
    run_events(app, options, streams.out)
