"""The ``outbox`` parser: ``outbox <lane> <verb>``, plus the processes; and its dispatch.

Every parser a verb ends on sets ``run``, the function that does its work, as a
default: dispatching is calling it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ..exceptions import OutboxValueError
from ..text import check_text
from . import events, flows, handlers, ordering, tasks
from .exits import ExitStatus
from .options import Streams
from .relay import add_relay, run_health

#: The lanes of work, in the order the help lists them.
LANES: dict[str, ModuleType] = {
    "tasks": tasks,
    "ordering": ordering,
    "handlers": handlers,
    "events": events,
    "flows": flows,
}

DESCRIPTION = (
    "celery-outbox. Usage: outbox <lane> <verb> [selectors] [options]. "
    "Lanes: tasks (plain tasks), ordering (ordered keys), handlers (handler "
    "outboxes), events (events to other services), flows (flow control's "
    "rates). Verbs, the same on every lane that has them: stats, inspect, replay, purge, pause, resume, retry, skip. "
    "'outbox events' is not 'celery events' (worker monitoring) and 'outbox tasks "
    "inspect' is not 'celery inspect' (worker control): both act on the outbox. "
    "'outbox <lane> --help' lists a lane's verbs."
)


def build(parser: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Add every command, lane and verb."""
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{relay,health,tasks,ordering,handlers,events,flows}",
    )
    add_relay(
        commands.add_parser(
            "relay",
            help="Run the relay: publish committed rows to the broker.",
            description="Run the relay: publish committed rows to the broker. Each "
            "flag overrides its CELERY_OUTBOX_* setting for this process.",
            **kwargs,
        )
    )
    commands.add_parser(
        "health",
        help="Exit non-zero with a reason when the database or the broker is "
        "unreachable.",
        **kwargs,
    ).set_defaults(run=run_health)
    for name, lane in LANES.items():
        parser = commands.add_parser(
            name,
            help=lane.HELP,
            description=f"{lane.HELP} Usage: outbox {name} <verb>; "
            f"'outbox {name} <verb> --help' lists a verb's flags.",
            **kwargs,
        )
        lane.add(parser, kwargs)


def dispatch(options: dict[str, Any], out: Any, err: Any) -> None:
    """Run what ``options`` (as parsed by :func:`build`'s parser) asks for."""
    words = [options.get(word) for word in ("command", "verb")]
    where = " ".join(str(word) for word in words if isinstance(word, str))
    for dest, value in options.items():
        refuse_unholdable(
            (value,), POSITIONALS.get(dest, f"--{dest.replace('_', '-')}"), where
        )
    options["run"](options, Streams(out, err))


#: The positional arguments of the grammar, by their option name, as the help
#: writes them (every other option is its flag).
POSITIONALS = {"ids": "ID", "task_id": "TASK_ID", "flow": "FLOW", "rates": "RATE"}


def refuse_unholdable(
    arguments: Iterable[object], what: str = "argument", where: str = "outbox"
) -> None:
    """Refuse, as a usage error, any text among ``arguments`` no row can hold.

    A NUL or a lone surrogate (what Python makes of bytes that are not UTF-8 on a
    command line) names nothing in the outbox; left in, it fails deep in a query or
    in printing. Checked on the command line before it is parsed (:func:`run`), and
    on the parsed options (``call_command``).
    """
    for argument in arguments:
        texts = argument if isinstance(argument, (list, tuple)) else (argument,)
        for text in texts:
            if not isinstance(text, str):
                continue
            try:
                check_text(text, what, where or "outbox")
            except OutboxValueError as exc:
                raise CommandError(str(exc), returncode=ExitStatus.USAGE) from None


def run(command: BaseCommand, argv: list[str]) -> None:
    """``command.run_from_argv(argv)``, after :func:`refuse_unholdable` of ``argv``:
    one line on stderr and the usage status, before argparse or Django see it."""
    try:
        refuse_unholdable(argv[2:])
    except CommandError as exc:
        command.stderr.write(f"CommandError: {exc}")
        sys.exit(exc.returncode)
    BaseCommand.run_from_argv(command, argv)
