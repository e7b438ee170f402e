"""Every verb of every ``outbox`` command refuses text no row can hold, in one line.

Bytes that are not UTF-8 on a command line reach Python as lone surrogates; a NUL
can come through ``call_command``. The grammar refuses both before any verb runs:
one line on stderr, the usage status, no traceback. The verbs are found by walking
the parser, so a verb added later is checked too.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import BaseCommand

from celery_outbox.cli.exits import ExitStatus
from celery_outbox.management.commands import outbox

#: What ``os.fsdecode`` makes of the byte 0xff on a command line.
NOT_UTF8 = "\udcff"


def verbs(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under ``parser`` that runs something, with its words."""
    if parser.get_default("run") is not None:
        yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, child in action.choices.items():
                yield from verbs(child, (*path, word))


def argv_with(parser: argparse.ArgumentParser, bad: str) -> list[str]:
    """The verb's arguments with ``bad`` where a text goes: its first positional,
    else its first option that takes free text, else at the end; required options
    get a plain value."""
    argv: list[str] = []
    placed = False
    for action in parser._actions:
        positional = not action.option_strings and not isinstance(
            action, argparse._SubParsersAction
        )
        if positional and not placed:
            argv.append(bad)
            placed = True
    for action in parser._actions:
        takes_text = (
            action.option_strings
            and action.nargs is None
            and action.type is None
            and action.choices is None
            and not isinstance(action, argparse._HelpAction)
            and action.const is None
        )
        if takes_text and not placed:
            argv += [action.option_strings[0], bad]
            placed = True
        elif action.required and action.option_strings:
            argv += [action.option_strings[0], "x"]
    return argv if placed else [*argv, bad]


def every_verb() -> list[tuple[str, ...]]:
    parser = outbox.Command().create_parser("manage.py", "outbox")
    return [
        (*path, *argv_with(verb, NOT_UTF8)) for path, verb in verbs(parser, ("outbox",))
    ]


@pytest.mark.parametrize("argv", every_verb(), ids=" ".join)
def test_every_verb_refuses_bytes_that_are_not_utf8_in_one_line(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    command: BaseCommand = outbox.Command()
    with pytest.raises(SystemExit) as exited:
        command.run_from_argv(["manage.py", *argv])
    assert exited.value.code == ExitStatus.USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()], err
    assert err.startswith("CommandError: outbox: argument ")
    assert "lone surrogate" in err


def test_the_walk_finds_the_verbs_of_every_lane() -> None:
    words = {argv[:3] for argv in every_verb()}
    for expected in (
        ("outbox", "relay", "--liveness-file"),
        ("outbox", "tasks", "inspect"),
        ("outbox", "handlers", "run"),
        ("outbox", "events", "replay"),
        ("outbox", "flows", "limit"),
        ("outbox", "ordering", "skip"),
    ):
        assert expected in words, sorted(words)


@pytest.mark.parametrize("bad", ["\x00", NOT_UTF8], ids=["nul", "surrogate"])
def test_call_command_refuses_it_too(bad: str) -> None:
    with pytest.raises(CommandError) as raised:
        call_command("outbox", "tasks", "inspect", f"id{bad}")
    assert raised.value.returncode == ExitStatus.USAGE
    assert "at position 2" in str(raised.value)
