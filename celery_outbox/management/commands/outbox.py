"""``python manage.py outbox <lane> <verb>``: parse, then call (see :mod:`celery_outbox.cli`)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...cli import grammar
from ...exceptions import OutboxError
from ..errors import command_error


class Command(BaseCommand):
    help = grammar.DESCRIPTION

    def add_arguments(self, parser: CommandParser) -> None:
        grammar.build(parser, {"called_from_command_line": True})

    def run_from_argv(self, argv: list[str]) -> None:
        grammar.run(self, argv)  # text no row can hold: refused before parsing

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            grammar.dispatch(options, self.stdout, self.stderr)
        except OutboxError as exc:
            raise command_error(exc) from exc
