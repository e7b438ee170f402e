"""``outbox ordering <verb>``: ordered keys and their blocked heads.

The admin's actions on blocked heads (:mod:`celery_outbox.ordering.admin`) call the
same store methods.
"""

from __future__ import annotations

import argparse
import json
from fnmatch import fnmatchcase
from typing import Any

from django.core.management.base import CommandError

from .options import Streams, add_format, add_top
from .selectors import Selection, add_selectors

HELP = "Ordered keys: their backlog and their blocked heads."

_OFFERED = "--key KEY, --name GLOB"


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Add ``ordering``'s verbs to its parser."""
    verbs = lane.add_subparsers(dest="verb", required=True, metavar="VERB")
    stats = verbs.add_parser(
        "stats", help="Print keys waiting, blocked heads, the deepest keys.", **kwargs
    )
    add_format(stats)
    add_top(stats, "deepest keys")
    stats.set_defaults(run=run_stats)
    for verb, text in (
        ("retry", "Publish blocked heads again, with fresh attempts."),
        (
            "skip",
            "Move blocked heads to the dead letters (or delete them) so that the "
            "rest of their keys goes on.",
        ),
    ):
        parser = verbs.add_parser(verb, help=text, **kwargs)
        add_head_selectors(parser)
        if verb == "skip":
            parser.add_argument(
                "--delete", action="store_true", help="Delete them, no dead letter."
            )
        parser.set_defaults(run=run_heads)


def add_head_selectors(parser: argparse.ArgumentParser) -> None:
    """Which blocked heads ``retry`` and ``skip`` act on."""
    add_selectors(
        parser,
        key="The key whose blocked head to act on (repeat for several).",
        name="The head's task name or glob.",
        everything="Every blocked head.",
        dry_run="Only list the blocked heads it would act on.",
    )


def run_stats(options: dict[str, Any], streams: Streams) -> None:
    """Print the ordered keys' statistics."""
    from ..store import outbox_stores

    stats = outbox_stores().ordering().ordering_stats(options["top"])
    if options["format"] == "json":
        streams.line(json.dumps(stats.as_dict(), indent=2))
        return
    streams.line(
        f"keys {stats.keys}  rows {stats.keyed_rows}  running {stats.running}  "
        f"blocked {len(stats.blocked)}  oldest head {stats.oldest_head_seconds}"
    )
    for head in stats.blocked:
        streams.line(
            f"blocked {head.key}: {head.task_name}[{head.task_id}] "
            f"({head.rows} rows, for {_age(head.blocked_seconds)}) "
            f"{head.last_error[:200]}"
        )
    for depth in stats.deepest:
        streams.line(f"deep {depth.key}: {depth.rows} rows")


def run_heads(options: dict[str, Any], streams: Streams) -> None:
    """``retry`` or ``skip`` the selected blocked heads."""
    from ..store import outbox_stores

    verb = options["verb"]
    selection = Selection.of(options)
    selection.require(f"ordering {verb}", _OFFERED)
    store = outbox_stores().ordering()
    heads = [
        head
        for head in store.blocked_heads()
        if (not selection.keys or head.key in selection.keys)
        and (selection.name is None or fnmatchcase(head.task_name, selection.name))
    ]
    missing = sorted(set(selection.keys) - {head.key for head in heads})
    for head in heads:
        if selection.dry_run:
            streams.line(f"would {verb}: the head of {head.key!r} ({head.task_name})")
            continue
        if verb == "retry":
            changed = store.retry_head(head.key)
        else:
            changed = store.skip_head(head.key, dead_letter=not options["delete"])
        if changed:
            streams.line(f"{verb}: the head of {head.key!r}")
        else:  # settled by a relay between the listing and the change
            missing.append(head.key)
    if missing:
        raise CommandError(
            f"Key {', '.join(repr(key) for key in missing)} has no blocked head "
            f"('outbox ordering stats' lists them)."
        )
    if not heads:
        streams.line(f"no blocked head matched; nothing to {verb}")


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s"
