"""The spellings of 0.1, kept for the 0.x line: each runs, warns, and names the new one.

Each old spelling has a parser of its own, unlisted in the help, whose flags fill
the same option names as the new verb's (``--task`` fills ``name``, ``--shard``
fills ``key``...), and whose ``run`` warns before doing the new verb's work.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..deprecation import deprecated
from . import events, handlers, ordering, tasks
from .options import Run, Streams, add_databases, positive


def spelled(old: str, new: str, run: Run) -> Run:
    """``run``, after a DeprecationWarning (and a line on stderr) naming ``new``."""

    def warn_then_run(options: dict[str, Any], streams: Streams) -> None:
        message = deprecated(f"'{old}'", f"'{new}'")
        streams.err.write(f"warning: {message}")
        run(options, streams)

    return warn_then_run


def add(commands: Any, kwargs: dict[str, Any]) -> None:
    """The old top-level spellings: ``stats``, ``inspect``, ``replay``, ``purge``,
    ``handler-stats``, ``handler-replay``, ``pause``, ``resume``."""
    stats = commands.add_parser("stats", **kwargs)
    tasks.add_stats_arguments(stats)
    stats.set_defaults(
        top=None, run=spelled("outbox stats", "outbox tasks stats", tasks.run_stats)
    )
    inspect = commands.add_parser("inspect", **kwargs)
    tasks.add_inspect_arguments(inspect)
    inspect.set_defaults(
        run=spelled("outbox inspect", "outbox tasks inspect", tasks.run_inspect)
    )
    replay = commands.add_parser("replay", **kwargs)
    replay.add_argument("ids", nargs="*")
    replay.add_argument("--task", dest="name", default=None)
    replay.add_argument("--since", default=None)
    replay.add_argument("--until", default=None)
    replay.add_argument("--all", action="store_true")
    replay.add_argument("--dry-run", action="store_true")
    replay.add_argument("--chunk-size", type=positive(int), default=500)
    replay.set_defaults(
        run=spelled("outbox replay", "outbox tasks replay", tasks.run_replay)
    )
    purge = commands.add_parser("purge", **kwargs)
    purge.add_argument("--older-than", default=None)
    purge.add_argument("--task", default=None)
    purge.add_argument("--all", action="store_true")
    purge.add_argument("--dry-run", action="store_true")
    purge.add_argument("--chunk-size", type=positive(int), default=1000)
    purge.set_defaults(
        run=spelled(
            "outbox purge",
            "outbox tasks purge --until 7d (or --name GLOB, or --all)",
            _purge,
        )
    )
    _add_handler_spellings(commands, kwargs)


def _purge(options: dict[str, Any], streams: Streams) -> None:
    """The old purge: no selector meant "older than the retention setting"."""
    from ..conf import get_settings
    from ..operations import PurgeRequest, purge
    from ..store import outbox_stores

    request = PurgeRequest.parse(
        older_than=options["older_than"],
        retention=get_settings().dead_letter_retention,
        task=options["task"],
        dry_run=options["dry_run"],
        chunk_size=options["chunk_size"],
        everything=options["all"],
    )
    streams.line(purge(outbox_stores().operator(), request))


def _add_handler_spellings(commands: Any, kwargs: dict[str, Any]) -> None:
    stats = commands.add_parser("handler-stats", **kwargs)
    handlers.add_stats_arguments(stats)
    stats.set_defaults(
        run=spelled("outbox handler-stats", "outbox handlers stats", handlers.run_stats)
    )
    replay = commands.add_parser("handler-replay", **kwargs)
    replay.add_argument("--id", dest="ids", type=positive(int), action="append")
    replay.add_argument("--category", dest="name", default=None)
    replay.add_argument("--shard", dest="key", action="append", default=None)
    replay.add_argument("--all", action="store_true")
    add_databases(replay)
    replay.set_defaults(
        ids=None,
        run=spelled(
            "outbox handler-replay", "outbox handlers replay", handlers.run_replay
        ),
    )
    for verb in ("pause", "resume"):
        parser = commands.add_parser(verb, **kwargs)
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--category", dest="name", default=None)
        target.add_argument("--shard", dest="key", default=None)
        if verb == "pause":
            parser.add_argument("--reason", default="")
        add_databases(parser)
        parser.set_defaults(
            verb=verb,
            run=spelled(
                f"outbox {verb}", f"outbox handlers {verb}", handlers.run_switch
            ),
        )


def add_to_lane(
    name: str, lane: argparse.ArgumentParser, verbs: Any, kwargs: dict[str, Any]
) -> None:
    """The old spellings under a lane: bare ``outbox handlers``, ``events archive``."""
    if name == "handlers":
        handlers.add_run_arguments(lane, hidden=True)
        lane.set_defaults(
            run=spelled(
                "outbox handlers", "outbox handlers run", handlers.run_processor
            )
        )
    elif name == "events":
        _add_archive(verbs, kwargs)


def _add_archive(verbs: Any, kwargs: dict[str, Any]) -> None:
    """``outbox events archive count|list|replay|purge``."""
    archive = verbs.add_parser("archive", **kwargs)
    actions = archive.add_subparsers(dest="verb", required=True)
    old = "outbox events archive"
    actions.add_parser("count", **kwargs).set_defaults(
        run=spelled(f"{old} count", "outbox events stats", events.run)
    )
    listing = actions.add_parser("list", **kwargs)
    events.add_inspect_arguments(listing)
    listing.set_defaults(
        verb="inspect", run=spelled(f"{old} list", "outbox events inspect", events.run)
    )
    replay = actions.add_parser("replay", **kwargs)
    replay.add_argument("ids", nargs="*")
    replay.add_argument("--event", dest="name", default=None)
    replay.add_argument("--all", action="store_true")
    replay.set_defaults(
        run=spelled(f"{old} replay", "outbox events replay", events.run)
    )
    actions.add_parser("purge", **kwargs).set_defaults(
        all=True,
        run=spelled(f"{old} purge", "outbox events purge --all", events.run),
    )


def add_ordering_command(
    parser: argparse.ArgumentParser, kwargs: dict[str, Any]
) -> None:
    """``manage.py outbox_ordering stats|retry KEY|skip KEY|dead-letter KEY``."""
    actions = parser.add_subparsers(dest="verb", required=True)
    stats = actions.add_parser("stats", **kwargs)
    ordering.add_stats_arguments(stats)
    stats.set_defaults(
        run=spelled(
            "outbox_ordering stats", "outbox ordering stats", ordering.run_stats
        )
    )
    for verb, new in (
        ("retry", "outbox ordering retry --key KEY"),
        ("skip", "outbox ordering skip --key KEY"),
        ("dead-letter", "outbox ordering skip --key KEY"),
    ):
        action = actions.add_parser(verb, **kwargs)
        action.add_argument("key", nargs=1)
        if verb == "skip":
            action.add_argument("--delete", action="store_true")
        action.set_defaults(
            verb="retry" if verb == "retry" else "skip",
            delete=False,
            run=spelled(f"outbox_ordering {verb}", new, ordering.run_heads),
        )
