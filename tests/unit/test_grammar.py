"""The ``outbox`` grammar refuses what it must before touching a database or broker."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from celery_outbox.management.commands.outbox import Command


@pytest.mark.parametrize(
    ("args", "offered"),
    [
        (("tasks", "purge"), "--until WHEN, --name GLOB"),
        (("tasks", "purge", "--dry-run"), "--until WHEN, --name GLOB"),
        (("ordering", "skip"), "--key KEY, --name GLOB"),
        (("ordering", "retry", "--dry-run"), "--key KEY, --name GLOB"),
        (("handlers", "replay"), "ids, --name GLOB, --key KEY"),
    ],
    ids=" ".join,
)
def test_a_verb_that_changes_refuses_an_empty_selection_and_names_all(
    args: tuple[str, ...], offered: str
) -> None:
    with pytest.raises(CommandError) as raised:
        call_command("outbox", *args, stdout=StringIO())
    assert f"say which: {offered}, or --all for every one" in str(raised.value)


@pytest.mark.parametrize(
    "args",
    [
        ("tasks", "purge", "--all", "--name", "x"),
        ("ordering", "skip", "--all", "--key", "A"),
        ("handlers", "replay", "--all", "7"),
    ],
    ids=" ".join,
)
def test_all_cannot_be_combined_with_a_selector(args: tuple[str, ...]) -> None:
    with pytest.raises(CommandError, match="--all cannot be combined"):
        call_command("outbox", *args, stdout=StringIO())


def test_every_lane_help_reads_alike(capsys: pytest.CaptureFixture[str]) -> None:
    parser = Command().create_parser("manage.py", "outbox")
    assert "Usage: outbox <lane> <verb>" in " ".join(parser.format_help().split())
    for lane in ("tasks", "ordering", "handlers", "events"):
        with pytest.raises(SystemExit):
            parser.parse_args([lane, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"Usage: outbox {lane} <verb>; 'outbox {lane} <verb> --help'" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["events", "--help"])
    assert "not 'celery events'" in " ".join(capsys.readouterr().out.split())
