"""``outbox tasks <verb>``: the outbox of plain tasks (``.delay()`` inside ``atomic()``)."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from typing import Any

from django.core.management.base import CommandError

from ..durations import parse_moment
from .options import Streams, add_format, add_top, positive
from .selectors import Selection, add_selectors

HELP = "Plain tasks: the outbox's backlog and its dead letters."


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Add ``tasks``'s verbs to its parser."""
    verbs = lane.add_subparsers(dest="verb", required=True, metavar="VERB")
    stats = verbs.add_parser(
        "stats", help="Print the backlog and the failing task names.", **kwargs
    )
    add_format(stats, "prometheus")
    add_top(stats, "task names that fail most (retrying and dead)")
    stats.add_argument(
        "--watch",
        type=positive(float),
        default=None,
        metavar="SECONDS",
        help="Print again every SECONDS until Ctrl-C.",
    )
    stats.add_argument(
        "--iterations", type=positive(int), default=None, help=argparse.SUPPRESS
    )
    stats.set_defaults(run=run_stats)
    inspect = verbs.add_parser(
        "inspect",
        help="Say where a message is (waiting, in flight, retrying, dead, published), "
        "with its history; exit 1 for an unknown task id. Not 'celery inspect', which "
        "asks workers.",
        **kwargs,
    )
    inspect.add_argument("task_id", help="The task id (AsyncResult.id).")
    add_format(inspect)
    inspect.set_defaults(run=run_inspect)
    replay = verbs.add_parser(
        "replay",
        help="Put dead letters back into the outbox (same message, attempts reset, "
        "due now).",
        **kwargs,
    )
    add_selectors(
        replay,
        ids="Dead-letter ids (the admin shows them).",
        name="Task name or glob.",
        since="Died",
        until="Died",
        everything="Every dead letter.",
        dry_run="Only say what would be replayed.",
        chunk_size=500,
    )
    replay.set_defaults(run=run_replay)
    purge = verbs.add_parser("purge", help="Delete dead letters, in chunks.", **kwargs)
    add_selectors(
        purge,
        name="Task name or glob.",
        until="Died",
        everything="Every dead letter, of any age.",
        dry_run="Only count.",
        chunk_size=1000,
    )
    purge.set_defaults(run=run_purge)


def run_stats(options: dict[str, Any], streams: Streams) -> None:
    """Print the backlog, once or every ``--watch`` seconds."""
    from ..operations import StatsRequest, watch
    from ..store import outbox_stores

    request = StatsRequest(
        format=options["format"],
        top=options["top"],
        interval=options["watch"],
        iterations=options["iterations"],
    )
    watch(outbox_stores().operator(), request, streams.line)


def run_inspect(options: dict[str, Any], streams: Streams) -> None:
    """Print where one message is, with its history."""
    from ..inspection import InspectRequest, inspect_message
    from ..store import outbox_stores

    request = InspectRequest.parse(task_id=options["task_id"], format=options["format"])
    trace = outbox_stores().history_log().trace(request.task_id)
    streams.line(inspect_message(trace, request))


def run_replay(options: dict[str, Any], streams: Streams) -> None:
    """Put the selected dead letters back into the outbox."""
    from ..operations import ReplayRequest, replay
    from ..store import outbox_stores

    request = ReplayRequest.parse(
        ids=options["ids"],
        task=options["name"],
        since=options["since"],
        until=options["until"],
        everything=options["all"],
        dry_run=options["dry_run"],
        chunk_size=options["chunk_size"],
    )
    streams.line(replay(outbox_stores().operator(), request, streams.err))


def run_purge(options: dict[str, Any], streams: Streams) -> None:
    """Delete the selected dead letters."""
    from ..operations import PurgeRequest, purge
    from ..store import outbox_stores

    selection = Selection.of(options)
    selection.require("tasks purge", "--until WHEN, --name GLOB")
    older_than = 0.0
    if selection.until is not None:
        now = datetime.now(timezone.utc)
        try:
            moment = parse_moment(selection.until, now)
        except ValueError as exc:
            raise CommandError(f"--until: {exc}") from None
        older_than = max((now - moment).total_seconds(), 0.0)
    request = PurgeRequest(
        older_than, selection.name, selection.dry_run, options["chunk_size"]
    )
    streams.line(purge(outbox_stores().operator(), request))
