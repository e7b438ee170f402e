"""The ranges pyproject.toml declares are the ones the nox matrix tests.

A Django, Celery or Python line added to the matrix and not to the metadata (or the
other way round) fails here: a user's ``pip install`` must neither refuse a tested
release nor accept an untested line.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from importlib import metadata
from itertools import product
from pathlib import Path
from typing import Any

import pytest
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


# -- every other dependency: a range closed at a major nothing here has tested -------

#: The release lines of the matrix (Django and Celery: the checks above).
MATRIX_AXES = {"django", "celery"}
#: The extras that are ours to use, not a user's.
DEVELOPMENT_EXTRAS = {"test", "lint", "dev"}


def user_requirements() -> list[Requirement]:
    """What ``pip install 'celery-outbox[every extra]'`` may install."""
    lines = list(PROJECT["dependencies"])
    for extra, found in PROJECT["optional-dependencies"].items():
        if extra not in DEVELOPMENT_EXTRAS:
            lines += found
    return [Requirement(line) for line in lines]


def bounds(requirement: Requirement) -> tuple[Version, Version]:
    """(lowest admitted, first refused) of a ``>=X,<Y`` requirement."""
    found = {s.operator: Version(s.version) for s in requirement.specifier}
    return found[">="], found["<"]


def test_every_dependency_is_closed_at_the_next_major_of_what_is_tested() -> None:
    for requirement in user_requirements():
        if requirement.name.lower() in MATRIX_AXES:
            continue
        operators = {s.operator for s in requirement.specifier}
        assert operators == {">=", "<"}, (
            f"{requirement}: declare '>=lowest tested,<next major' (the oldest "
            f"session installs the lowest, the newest the newest release)"
        )
        lowest, refused = bounds(requirement)
        # '<N' with N a whole major, and the lowest inside the major below it.
        assert refused.release == (refused.major,), requirement
        assert lowest.major < refused.major, requirement


def test_the_test_extra_asks_for_the_libraries_in_the_users_ranges() -> None:
    users = {r.name.lower(): r.specifier for r in user_requirements()}
    for line in PROJECT["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        if requirement.name.lower() in users:
            assert requirement.specifier == users[requirement.name.lower()], line


def test_the_oldest_session_installs_every_extra_at_its_lowest() -> None:
    offered = set(PROJECT["optional-dependencies"]) - DEVELOPMENT_EXTRAS
    assert set(noxfile_constant("EXTRAS")) == offered


def test_each_older_major_session_is_a_session_of_the_matrix_inside_the_range() -> None:
    users = {r.name.lower(): r.specifier for r in user_requirements()}
    for line, session in noxfile_constant("OLDER_MAJORS"):
        requirement = Requirement(line)
        assert tuple(session) in SESSIONS, line
        [below] = requirement.specifier
        assert below.operator == "<", line
        # Below the newest major the range admits, and above its lowest.
        lowest = min(Version(s.version) for s in users[requirement.name.lower()])
        assert lowest < Version(below.version), line
        assert Version(below.version) in users[requirement.name.lower()], line


def lock() -> dict[str, list[tuple[Version, str]]]:
    """requirements/check.txt: each name's pinned versions, with their markers."""
    found: dict[str, list[tuple[Version, str]]] = {}
    for line in (ROOT / "requirements" / "check.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            pinned = Requirement(line)
            [spec] = pinned.specifier
            found.setdefault(pinned.name.lower(), []).append(
                (Version(spec.version), str(pinned.marker or ""))
            )
    return found


def test_the_lock_pins_every_declared_requirement_inside_its_range() -> None:
    """``make lock`` was run after the last change to a range in pyproject.toml."""
    pinned = lock()
    lines = list(PROJECT["dependencies"])
    for found in PROJECT["optional-dependencies"].values():
        lines += found
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate():
            continue
        name = requirement.name.lower()
        assert name in pinned, f"{name} is not in requirements/check.txt: `make lock`"
        for version, _ in pinned[name]:
            assert version in requirement.specifier, (
                f"requirements/check.txt pins {name} {version} outside {line}: "
                f"`make lock`"
            )


def test_the_matrix_pins_the_test_tools_the_lock_holds() -> None:
    pinned = lock()
    for name in noxfile_constant("TOOLS"):
        assert name.lower() in pinned, f"noxfile TOOLS names {name}; the lock has not"


@pytest.mark.skipif(
    os.environ.get("OUTBOX_MATRIX_SESSION") not in {"oldest", "newest"},
    reason="reads what the matrix's oldest and newest sessions installed",
)
def test_the_session_installed_the_ends_of_every_range() -> None:
    """The oldest session has each lowest version; the newest has the top major."""
    oldest = os.environ["OUTBOX_MATRIX_SESSION"] == "oldest"
    for requirement in user_requirements():
        if requirement.name.lower() in MATRIX_AXES:
            continue
        installed = Version(metadata.version(requirement.name))
        lowest, refused = bounds(requirement)
        if oldest:
            assert installed == lowest, requirement
        else:
            assert installed.major == refused.major - 1, (
                f"{requirement.name} {installed}: the newest session runs the newest "
                f"major the range admits"
            )


def test_each_line_runs_its_own_tests_in_one_session_besides_the_newest() -> None:
    """What depends on one line alone runs once per line, not once per pair."""
    for constant, axis in (("CELERY_LINE_SESSIONS", 2), ("DJANGO_LINE_SESSIONS", 1)):
        chosen = [tuple(row) for row in noxfile_constant(constant)]
        assert set(chosen) <= set(SESSIONS) - {NEWEST}, constant
        lines = sorted((row[axis] for row in chosen), key=Version)
        assert lines == (CELERYS if axis == 2 else DJANGOS), constant
        assert OLDEST in chosen, constant
    # And no file is in two of the groups, nor left out of all of them.
    groups = [
        set(noxfile_constant(name))
        for name in ("CONTRACT_TESTS", "CELERY_LINE_TESTS", "DJANGO_LINE_TESTS")
    ]
    assert sum(len(g) for g in groups) == len(set().union(*groups))
    for path in set().union(*groups):
        assert (ROOT / path).exists(), path
