"""The package's layers hold: no module imports from a layer above its own.

Every import counts, at module level, inside a function or under ``TYPE_CHECKING``.
The map is the one ``docs/explanation.md`` draws ("Layers"); an import that has to go
upward for now is listed in :data:`ALLOWED` with its reason.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_outbox"

#: The layers, bottom first. A module may import from its own layer and those below.
LAYERS = ("values", "stores", "engine", "lanes", "top")

#: Where each module lives: the longest matching name wins. Every module must match
#: an entry (the package itself matches only ``celery_outbox``, exactly).
PLACES = {
    # Values and settings: plain data, pure decisions, settings, errors.
    "celery_outbox.caches": "values",
    "celery_outbox.conf": "values",
    "celery_outbox.decoding": "values",
    "celery_outbox.durations": "values",
    "celery_outbox.envelope": "values",
    "celery_outbox.exceptions": "values",
    "celery_outbox.outcomes": "values",
    "celery_outbox.progress": "values",
    "celery_outbox.queues": "values",
    "celery_outbox.redaction": "values",
    "celery_outbox.scheduling": "values",
    "celery_outbox.states": "values",
    "celery_outbox.text": "values",
    "celery_outbox.deprecation": "values",
    # Ordered keys' options and head rule: values the store's claim applies.
    "celery_outbox.ordering.core": "values",
    "celery_outbox.ordering.options": "values",
    # Flow control's rates and decisions: values the gate and its store apply.
    "celery_outbox.flow": "values",
    "celery_outbox.flow.core": "values",
    # Stores and brokers: every read and write of the tables, every broker call.
    "celery_outbox.backends": "stores",
    "celery_outbox.broker": "stores",
    "celery_outbox.collation": "stores",
    "celery_outbox.migrations": "stores",
    "celery_outbox.models": "stores",
    "celery_outbox.store": "stores",
    # The handler app's tables: its store (celery_outbox.store.handlers) reads them.
    "celery_outbox.handlers.migrations": "stores",
    "celery_outbox.handlers.models": "stores",
    # The engine of leased work, and the gate that limits what a lane publishes.
    "celery_outbox.engine": "engine",
    "celery_outbox.flow.gate": "engine",
    # A flow key's slots, started and freed by the worker's reports.
    "celery_outbox.flow.worker": "lanes",
    # Lanes, and what observes them.
    "celery_outbox.events": "lanes",
    "celery_outbox.handlers": "lanes",
    "celery_outbox.inbox": "lanes",
    "celery_outbox.metrics": "lanes",
    "celery_outbox.ordering": "lanes",
    "celery_outbox.relay": "lanes",
    "celery_outbox.signals": "lanes",
    # The task class, composed of the lanes' parts (inbox, ordering).
    "celery_outbox.task": "lanes",
    # On top: what a user calls, runs, configures or opens.
    "celery_outbox": "top",
    "celery_outbox.admin": "top",
    "celery_outbox.app": "top",
    "celery_outbox.apps": "top",
    "celery_outbox.checks": "top",
    "celery_outbox.cli": "top",
    "celery_outbox.contrib": "top",
    "celery_outbox.enqueue": "top",
    "celery_outbox.events.commands": "top",
    "celery_outbox.handlers.admin": "top",
    "celery_outbox.handlers.apps": "top",
    "celery_outbox.history_admin": "top",
    "celery_outbox.inbox.apps": "top",
    "celery_outbox.inbox.checks": "top",
    "celery_outbox.inspection": "top",
    "celery_outbox.management": "top",
    "celery_outbox.operations": "top",
    "celery_outbox.ordering.admin": "top",
    "celery_outbox.flow.admin": "top",
    "celery_outbox.pytest_plugin": "top",
    "celery_outbox.revoke": "top",
    "celery_outbox.relay.runner": "top",
    "celery_outbox.tasks": "top",
    "celery_outbox.testing": "top",
}

#: Imports that go upward for now, each with its reason: (importer, imported) -> why.
ALLOWED: dict[tuple[str, str], str] = {
    # A held event retry is written by the enqueue path's producer, so it is
    # serialized exactly as its first send was. The capture moves under the lanes
    # when the lanes are restructured on the engine.
    ("celery_outbox.events.held", "celery_outbox.enqueue"): "retry via the enqueue",
    # Handler messages share the enqueue path's transaction guard; the handler
    # outbox is being rebuilt as a lane on the engine, with the guard beside it.
    ("celery_outbox.handlers.emit", "celery_outbox.enqueue"): "the guard, for now",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is written."""

    path: Path
    line: int
    importer: str
    imported: str


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def place(module: str) -> str | None:
    """The layer of ``module``; None when the map has no entry for it."""
    name = module
    while name:
        if name in PLACES and (name != "celery_outbox" or module == name):
            return PLACES[name]
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path, root: Path = ROOT) -> Iterator[Import]:
    """Every import of the package's own modules in ``path``, wherever it is written."""
    importer = module_name(path, root)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # ``from . import x`` may name a module: then x is what is imported.
            targets = [
                f"{base}.{alias.name}"
                if is_module(f"{base}.{alias.name}", root)
                else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == "celery_outbox" or target.startswith("celery_outbox."):
                yield Import(path, node.lineno, importer, target)


def is_module(name: str, root: Path) -> bool:
    """Whether ``name`` is a module or package of the tree under ``root``."""
    relative = Path(*name.split("."))
    return (root / relative.with_suffix(".py")).exists() or (
        root / relative / "__init__.py"
    ).exists()


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def upward(found: Import) -> bool:
    own, other = place(found.importer), place(found.imported)
    assert own is not None and other is not None
    return LAYERS.index(other) > LAYERS.index(own)


def test_every_module_has_a_place_on_the_map() -> None:
    unplaced = [
        module_name(path) for path in modules() if place(module_name(path)) is None
    ]
    assert unplaced == [], (
        f"modules with no layer: {unplaced}. Add each to PLACES in {Path(__file__).name} "
        f"and to the map in docs/explanation.md."
    )


def test_nothing_imports_upward() -> None:
    problems = []
    for path in modules():
        for found in imports_of(path):
            if upward(found) and (found.importer, found.imported) not in ALLOWED:
                own, other = place(found.importer), place(found.imported)
                allowed = ", ".join(LAYERS[: LAYERS.index(str(own)) + 1])
                problems.append(
                    f"{path.relative_to(ROOT)}:{found.line}: {found.importer} "
                    f"({own}) imports {found.imported} ({other}); a module of the "
                    f"{own} layer imports only from {allowed}. Move what it needs "
                    f"down, or list the import in ALLOWED with the reason."
                )
    assert problems == [], "\n".join(problems)


def test_every_allowed_upward_import_still_exists() -> None:
    # An entry whose import is gone would let a new one through unnoticed.
    found = {
        (i.importer, i.imported)
        for path in modules()
        for i in imports_of(path)
        if upward(i)
    }
    assert sorted(set(ALLOWED) - found) == []


@pytest.mark.parametrize(
    "source",
    [
        "from ..relay.loop import Relay",  # relative, module level
        "def build():\n    from celery_outbox.relay import loop",  # in a function
        "import typing\nif typing.TYPE_CHECKING:\n    import celery_outbox.app",
    ],
)
def test_an_upward_import_is_found_wherever_it_is_written(
    source: str, tmp_path: Path
) -> None:
    fake = tmp_path / "celery_outbox" / "store"
    fake.mkdir(parents=True)
    path = fake / "fake.py"
    path.write_text(source)
    (found,) = list(imports_of(path, tmp_path))
    assert found.importer == "celery_outbox.store.fake"
    assert upward(found)


def test_the_explanation_draws_every_entry_of_the_map() -> None:
    text = (ROOT / "docs" / "explanation.md").read_text()
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    drawn = set(re.findall(r"`([\w.]+)/?`", section))
    missing = [
        name
        for name in PLACES
        if name != "celery_outbox" and name.removeprefix("celery_outbox.") not in drawn
    ]
    assert missing == [], f"not on the map in docs/explanation.md: {missing}"
