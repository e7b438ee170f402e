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
