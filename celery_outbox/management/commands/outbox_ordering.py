"""``manage.py outbox_ordering``: ordered keys' statistics and their blocked heads.

* ``stats [--top N] [--format json]``: keys waiting, rows in them, running strict
  heads, blocked keys with their head's last error, the deepest keys, the oldest head;
* ``retry KEY``: publish the blocked head of KEY again, with fresh attempts;
* ``skip KEY [--delete]``: move the blocked head of KEY to the dead letters (or
  delete it) so that the rest of the key goes on;
* ``dead-letter KEY``: move the blocked head of KEY to the dead letters (``skip``
  without ``--delete``, by its name).

The admin's actions on blocked heads (:mod:`celery_outbox.ordering.admin`) call the
same store methods.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...exceptions import OutboxError
from ..errors import command_error


class Command(BaseCommand):
    help = "Ordered keys: stats, and retry, skip or dead-letter a blocked key's head."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        stats = actions.add_parser("stats", help="keys waiting, blocked, deepest")
        stats.add_argument("--top", type=int, default=10)
        stats.add_argument("--format", choices=["text", "json"], default="text")
        retry = actions.add_parser("retry", help="publish a blocked head again")
        retry.add_argument("key")
        skip = actions.add_parser("skip", help="dead-letter a blocked head")
        skip.add_argument("key")
        skip.add_argument(
            "--delete", action="store_true", help="delete it, no dead letter"
        )
        dead = actions.add_parser(
            "dead-letter", help="move a blocked head to the dead letters"
        )
        dead.add_argument("key")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            self._handle(options)
        except OutboxError as exc:  # missing tables, an unreachable database
            raise command_error(exc) from exc

    def _handle(self, options: dict[str, Any]) -> None:
        from ...store import outbox_stores

        store = outbox_stores().ordering()
        action = options["action"]
        if action == "stats":
            stats = store.ordering_stats(options["top"])
            if options["format"] == "json":
                self.stdout.write(json.dumps(stats.as_dict(), indent=2))
                return
            self.stdout.write(
                f"keys {stats.keys}  rows {stats.keyed_rows}  running {stats.running}  "
                f"blocked {len(stats.blocked)}  oldest head {stats.oldest_head_seconds}"
            )
            for head in stats.blocked:
                self.stdout.write(
                    f"blocked {head.key}: {head.task_name}[{head.task_id}] "
                    f"({head.rows} rows, for {_age(head.blocked_seconds)}) "
                    f"{head.last_error[:200]}"
                )
            for depth in stats.deepest:
                self.stdout.write(f"deep {depth.key}: {depth.rows} rows")
            return
        key = options["key"]
        if action == "retry":
            changed = store.retry_head(key)
        elif action == "dead-letter":
            changed = store.dead_letter_head(key)
        else:
            changed = store.skip_head(key, dead_letter=not options["delete"])
        if not changed:
            raise CommandError(f"Key {key!r} has no blocked head.")
        self.stdout.write(f"{action}: the head of {key!r}")


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f} s"
