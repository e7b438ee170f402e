"""The ranges pyproject.toml declares are the ones the nox matrix tests.

A Django, Celery or Python line added to the matrix and not to the metadata (or the
other way round) fails here: a user's ``pip install`` must neither refuse a tested
release nor accept an untested line.
"""

from __future__ import annotations

import ast
import re
import sys
from itertools import product
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())[
    "project"
]


def noxfile_constant(name: str) -> Any:
    """A literal assigned at the top of noxfile.py (read: nox is not installed here)."""
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        match node:
            case ast.Assign(targets=[ast.Name(id=found)], value=value) if found == name:
                return ast.literal_eval(value)
    raise LookupError(f"noxfile.py assigns no {name}")


NEWEST = tuple(noxfile_constant("NEWEST"))
OLDEST = tuple(noxfile_constant("OLDEST"))
SESSIONS = [NEWEST, OLDEST, *(tuple(row) for row in noxfile_constant("CONTRACT"))]
PYTHONS = sorted({python for python, _, _ in SESSIONS}, key=Version)
DJANGOS = sorted({django for _, django, _ in SESSIONS}, key=Version)
CELERYS = sorted({celery for _, _, celery in SESSIONS}, key=Version)


def declared(name: str) -> SpecifierSet:
    """The version range of a core dependency."""
    [requirement] = [
        Requirement(line)
        for line in PROJECT["dependencies"]
        if Requirement(line).name.lower() == name
    ]
    return requirement.specifier


def next_line(line: str) -> str:
    """The release line after ``line`` (``6.1`` -> ``6.2``): the declared upper bound."""
    major, minor = Version(line).release[:2]
    return f"{major}.{minor + 1}"


def classifiers(prefix: str) -> list[str]:
    """The last part of every classifier under ``prefix``, as a sorted version list."""
    found = [
        c.removeprefix(prefix) for c in PROJECT["classifiers"] if c.startswith(prefix)
    ]
    return sorted((c for c in found if re.fullmatch(r"\d+\.\d+", c)), key=Version)


def readme_table() -> dict[tuple[str, str], str]:
    """The README's table of tested versions: (Django, Celery) -> its cell."""
    section = (ROOT / "README.md").read_text().split("## Tested versions\n", 1)[1]
    lines = section.split("\n## ", 1)[0].splitlines()
    header, _, *rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in lines
        if line.startswith("|")
    ]
    celerys = [cell.removeprefix("Celery ") for cell in header[1:]]
    return {
        (first.removeprefix("Django "), celery): cell
        for first, *cells in rows
        for celery, cell in zip(celerys, cells, strict=True)
    }


def test_every_django_line_meets_every_celery_line_once() -> None:
    pairs = [(django, celery) for _, django, celery in SESSIONS]
    assert sorted(pairs) == sorted(product(DJANGOS, CELERYS))


#: Every release line of Django and Celery from the oldest we test to the newest:
#: a line inside the declared range must be tested, one we do not test excluded.
RELEASE_LINES = {
    "django": ("4.2", "5.0", "5.1", "5.2", "6.0", "6.1"),
    "celery": ("5.4", "5.5", "5.6", "5.7"),
}


def test_the_declared_ranges_are_the_tested_lines() -> None:
    for name, lines in (("django", DJANGOS), ("celery", CELERYS)):
        spec = declared(name)
        assert f">={lines[0]}" in {str(s) for s in spec}, name
        assert f"<{next_line(lines[-1])}" in {str(s) for s in spec}, name
        assert RELEASE_LINES[name][0] == lines[0], name
        assert RELEASE_LINES[name][-1] == lines[-1], name
        for line in RELEASE_LINES[name]:
            # A project on any patch release of a tested line keeps it; an untested
            # line (Django 5.0 and 5.1) is not installable with us.
            assert (f"{line}.99" in spec) == (line in lines), (name, line)
            assert (f"{line}.0" in spec) == (line in lines), (name, line)


def test_the_oldest_session_is_the_declared_lower_bounds() -> None:
    assert (PYTHONS[0], DJANGOS[0], CELERYS[0]) == OLDEST
    assert PROJECT["requires-python"] == f">={PYTHONS[0]}"


def test_the_classifiers_name_the_tested_pythons_and_djangos() -> None:
    assert classifiers("Programming Language :: Python :: ") == PYTHONS
    assert classifiers("Framework :: Django :: ") == DJANGOS


def test_the_newest_session_runs_the_newest_of_everything() -> None:
    assert (PYTHONS[-1], DJANGOS[-1], CELERYS[-1]) == NEWEST


def test_the_readme_table_is_the_matrix() -> None:
    table = readme_table()
    assert {pair: cell.split()[0] for pair, cell in table.items()} == {
        (django, celery): python for python, django, celery in SESSIONS
    }
    assert table[OLDEST[1:]] == f"{OLDEST[0]} (lowest)"
    assert table[NEWEST[1:]] == f"{NEWEST[0]} (whole suite)"


def test_the_license_is_an_spdx_expression_the_build_backend_reads() -> None:
    # The older table form (`{ text = "MIT" }`) is deprecated: setuptools stops
    # building such projects after 2027-02-18. The string form needs setuptools 77.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert PROJECT["license"] == "MIT"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    [setuptools] = [
        Requirement(line)
        for line in pyproject["build-system"]["requires"]
        if Requirement(line).name == "setuptools"
    ]
    assert "76.1.0" not in setuptools.specifier
    assert "77.0.0" in setuptools.specifier
