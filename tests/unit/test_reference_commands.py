"""``docs/reference.md`` and the ``outbox`` parser list the same commands and flags.

Every command, lane and verb the help lists has its ``### `outbox ...``` heading, and
every flag it takes has a line in that heading's table; nothing documented there is
missing from the parser. The spellings of 0.1, removed in 0.2, are refused.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from celery_outbox.cli.exits import ExitStatus
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


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["stats"], "invalid choice: 'stats'"),
        (["inspect", "x"], "invalid choice: 'inspect'"),
        (["replay", "--all"], "invalid choice: 'replay'"),
        (["purge"], "invalid choice: 'purge'"),
        (["handler-stats"], "invalid choice: 'handler-stats'"),
        (["handler-replay", "--all"], "invalid choice: 'handler-replay'"),
        (["pause", "--category", "c"], "invalid choice: 'pause'"),
        (["resume", "--shard", "s"], "invalid choice: 'resume'"),
        (["handlers", "--until-empty"], "required: VERB"),
        (["events", "archive", "count"], "invalid choice: 'archive'"),
        (["tasks", "replay", "--task", "x"], "unrecognized arguments: --task"),
        (["tasks", "purge", "--older-than", "7d"], "unrecognized arguments: --older"),
        (["handlers", "replay", "--id", "3"], "unrecognized arguments: --id"),
        (["handlers", "replay", "--shard", "s"], "unrecognized arguments: --shard"),
        (["events", "replay", "--event", "x"], "unrecognized arguments: --event"),
    ],
    ids=" ".join,
)
def test_a_spelling_of_0_1_is_refused_as_a_usage_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        Command().run_from_argv(["manage.py", "outbox", *argv])
    assert exited.value.code == ExitStatus.USAGE
    assert said in capsys.readouterr().err


def test_the_0_1_command_outbox_ordering_is_unknown() -> None:
    with pytest.raises(CommandError, match="Unknown command: 'outbox_ordering'"):
        call_command("outbox_ordering", "stats")
