"""``manage.py outbox_ordering``: the 0.1 spelling of ``manage.py outbox ordering``.

Kept for the 0.x line; every use warns and names the new spelling
(:mod:`celery_outbox.cli.deprecated`).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...cli import deprecated, grammar
from ...exceptions import OutboxError
from ..errors import command_error


class Command(BaseCommand):
    help = "Deprecated: use 'manage.py outbox ordering stats|retry|skip'."

    def add_arguments(self, parser: CommandParser) -> None:
        deprecated.add_ordering_command(parser, {"called_from_command_line": True})

    def run_from_argv(self, argv: list[str]) -> None:
        grammar.run(self, argv)  # text no row can hold: refused before parsing

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            grammar.dispatch(options, self.stdout, self.stderr)
        except OutboxError as exc:  # missing tables, an unreachable database
            raise command_error(exc) from exc
