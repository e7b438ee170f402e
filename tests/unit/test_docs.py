"""The documentation names every setting the package reads."""

from __future__ import annotations

import re
from pathlib import Path

from celery_outbox.conf import _FIELDS

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_lists_every_setting() -> None:
    text = (ROOT / "docs" / "reference.md").read_text()
    section = text[text.index("## Settings") : text.index("## Fixed relay values")]
    listed = set(re.findall(r"^\| `CELERY_OUTBOX_([A-Z_]+)` \|", section, re.M))
    assert listed == set(_FIELDS)


def test_the_readme_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = text[text.index("```sh") : text.index("```", text.index("```sh") + 5)]
    assert "make demo" in first_block
    assert "make test" in first_block
    assert text.index("```sh") < text.index("\n## ")


def test_the_package_the_metadata_and_the_changelog_agree_on_the_version() -> None:
    from celery_outbox import __version__

    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\S+)", changelog, re.M)
    assert newest is not None
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, re.M)
    assert declared is not None
    assert newest.group(1) == declared.group(1) == __version__


def test_the_choosing_page_sets_every_lane_side_by_side_and_is_linked() -> None:
    text = (ROOT / "docs" / "choosing.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| | plain"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][1:]
    assert columns == [
        "plain task",
        "ordered task",
        "strict order",
        "handler outbox",
        "event",
        "inbox (switch)",
    ]
    for page in ("README.md", "docs/index.md", "docs/handlers.md"):
        assert "choosing.md" in (ROOT / page).read_text(), page
    # Tasks can be ordered (ordering_key, strict): no page may say otherwise.
    assert "no ordering." not in (ROOT / "docs" / "handlers.md").read_text()


def test_the_reference_prints_the_one_table_of_exit_statuses() -> None:
    from celery_outbox.cli.exits import ExitStatus

    text = (ROOT / "docs" / "reference.md").read_text()
    table = text.split("### Exit statuses", 1)[1].split("###", 1)[0]
    rows = [
        line.split("|")[1:3]
        for line in table.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]
    printed = {int(number): name.strip().strip("`") for number, name in rows}
    assert printed == {status.value: status.name for status in ExitStatus}
