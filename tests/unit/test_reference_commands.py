"""``docs/reference.md`` and the ``outbox`` parser list the same commands and flags.

Every command, lane and verb the help lists has its ``### `outbox ...``` heading, and
every flag it takes has a line in that heading's table; nothing documented there is
missing from the parser. Old spellings (unlisted in the help) are left out.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_outbox.management.commands.outbox import Command

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    return Command().create_parser("manage.py", "outbox")


def listed(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Each subcommand the help lists, as ``(name, parser)`` (argparse keeps them in
    ``_actions``; Django's ``call_command`` walks them the same way)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            shown = {choice.dest for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name in shown:
                    yield name, sub


def commands() -> dict[str, set[str]]:
    """``"outbox tasks replay"`` → the flags it shows (long options, positionals)."""
    found: dict[str, set[str]] = {}

    def walk(path: str, node: argparse.ArgumentParser) -> None:
        for name, sub in listed(node):
            flags = set()
            for action in sub._actions:
                if action.help == argparse.SUPPRESS or isinstance(
                    action, (argparse._SubParsersAction, argparse._HelpAction)
                ):
                    continue
                if action.option_strings:
                    flags.add(max(action.option_strings, key=len))
                else:
                    flags.add(str(action.metavar or action.dest).upper())
            found[f"{path} {name}"] = flags
            walk(f"{path} {name}", sub)

    walk("outbox", parser())
    return found


def sections() -> dict[str, str]:
    """``"outbox tasks replay"`` → its section of the reference."""
    text = (ROOT / "docs" / "reference.md").read_text()
    part = text[text.index("## `manage.py outbox`") : text.index("## Signals")]
    pieces = re.split(r"^### `(outbox[^`]*)`\n", part, flags=re.M)
    return dict(zip(pieces[1::2], pieces[2::2], strict=True))


def documented_flags(section: str) -> set[str]:
    """The first cell of each table row: ``--name``, ``ID``, ``TASK_ID``."""
    flags = set()
    for cell in re.findall(r"^\| `([^`]+)` \|", section, re.M):
        word = cell.split()[0]
        if word.startswith("--") or word.isupper():
            flags.add(word)
    return flags


def test_the_reference_has_a_section_for_every_command_and_no_other() -> None:
    assert set(sections()) == set(commands())


@pytest.mark.parametrize("command", sorted(commands()))
def test_the_reference_lists_every_flag_of(command: str) -> None:
    assert documented_flags(sections()[command]) == commands()[command]


def test_the_help_says_which_celery_commands_these_are_not() -> None:
    top = parser().format_help()
    assert "not 'celery events'" in " ".join(top.split())
    assert "not 'celery inspect'" in " ".join(top.split())
