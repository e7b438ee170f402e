"""The package's layers hold: no module imports from a layer above its own, and no
rooms import each other around a circle.

Every import counts, at module level, inside a function or under ``TYPE_CHECKING``.
The map is the one ``docs/explanation.md`` draws ("Layers"); an import that has to go
upward for now is listed in :data:`ALLOWED` with its reason. The rooms of a folder
are the modules and folders right below it (in ``celery_outbox``: ``task``,
``events``, ...; in ``celery_outbox.events``: ``delivery``, ``registry``, ...), in the
package and in ``bench/``; an import that closes a circle for now is listed in
:data:`ALLOWED_CIRCLES` with its reason.
"""

from __future__ import annotations

import ast
import functools
import itertools
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
    # What the enqueue takes from the caller's context (structlog, OpenTelemetry).
    "celery_outbox.propagation": "values",
    "celery_outbox.queues": "values",
    "celery_outbox.redaction": "values",
    "celery_outbox.scheduling": "values",
    "celery_outbox.states": "values",
    "celery_outbox.text": "values",
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
    # Where metrics go (StatsD, Prometheus): the relay's and the processor's observers
    # report to them.
    "celery_outbox.sinks": "stores",
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
    "celery_outbox.enqueue": "lanes",
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
    "celery_outbox.history_admin": "top",
    "celery_outbox.inspection": "top",
    "celery_outbox.management": "top",
    "celery_outbox.operations": "top",
    "celery_outbox.ordering.admin": "top",
    "celery_outbox.flow.admin": "top",
    "celery_outbox.pytest_plugin": "top",
    "celery_outbox.revoke": "top",
    "celery_outbox.tasks": "top",
    "celery_outbox.testing": "top",
}

#: Imports that go upward for now, each with its reason: (importer, imported) -> why.
ALLOWED: dict[tuple[str, str], str] = {}


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


def imports_of(
    path: Path, root: Path = ROOT, top: str = "celery_outbox"
) -> Iterator[Import]:
    """Every import of ``top``'s own modules in ``path``, wherever it is written."""
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
            if target == top or target.startswith(f"{top}."):
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


# -- circles -------------------------------------------------------------------

#: The trees whose folders hold no circle: the package, and the benchmark beside it.
TREES = (PACKAGE, ROOT / "bench")

#: Imports that close a circle between rooms for now, each with its reason:
#: (importer, imported module) -> why. They are left out of the graph, so a new
#: circle fails the test, and so does any other import along the same way. Each
#: is one of the upward imports of issue #47, whose value or hook moves down (or
#: whose old spelling goes) when it is mended; then its entry goes too
#: (test_every_allowed_circle_still_closes_one says when).
ALLOWED_CIRCLES: dict[tuple[str, str], str] = {
    # Values every layer needs, still in the lanes' folders (flow.core, ordering.core
    # and ordering.options): settings, the engine and the stores import them there.
    ("celery_outbox.conf", "celery_outbox.flow.core"): "settings build Flow values",
    ("celery_outbox.engine.gate", "celery_outbox.flow.core"): "the gate's Admission",
    ("celery_outbox.engine.gate", "celery_outbox.ordering.core"): "the head rule",
    ("celery_outbox.engine.endings", "celery_outbox.flow.core"): "flows' settlement",
    ("celery_outbox.engine.endings", "celery_outbox.ordering.core"): "keys' settlement",
    ("celery_outbox.engine.endings", "celery_outbox.ordering.options"): "policies",
    ("celery_outbox.store.ordering", "celery_outbox.ordering.core"): "the head rule",
    ("celery_outbox.store.ordering", "celery_outbox.ordering.options"): "policies",
    ("celery_outbox.store.protocol", "celery_outbox.ordering.options"): "policies",
    ("celery_outbox.flow.worker", "celery_outbox.ordering.core"): "keys' settlement",
    # The engine's reporter and heartbeat name the stores they write through.
    ("celery_outbox.engine.reports", "celery_outbox.store"): "the reporter's stores",
    ("celery_outbox.engine.heartbeat", "celery_outbox.store.protocol"): "its store",
    # The flow gate and its admin reach the stores from the lanes' folder.
    ("celery_outbox.flow.gate", "celery_outbox.store.protocol"): "the gate's store",
    ("celery_outbox.flow.admin", "celery_outbox.store"): "the admin's store",
}


def room(module: str, folder: str) -> str:
    """The room of ``module`` in ``folder``: the module or folder right below it.

    In ``celery_outbox``, ``celery_outbox.events.held`` is in ``celery_outbox.events``;
    in ``celery_outbox.events``, it is its own room. A folder's ``__init__`` is the
    folder's own room.
    """
    depth = len(folder.split(".")) + 1
    return ".".join(module.split(".")[:depth])


def folders() -> list[str]:
    """Every folder of the trees (a package with an ``__init__.py``), by module name."""
    return sorted(
        module_name(init) for tree in TREES for init in tree.rglob("__init__.py")
    )


def room_graph(
    folder: str, paths: list[Path], root: Path = ROOT
) -> dict[str, dict[str, list[Import]]]:
    """Which room of ``folder`` imports which, and by which imports."""
    top = folder.split(".")[0]
    graph: dict[str, dict[str, list[Import]]] = {}
    for path in paths:
        for found in imports_of(path, root, top):
            inside = (found.importer, found.imported)
            if not all(m == folder or m.startswith(f"{folder}.") for m in inside):
                continue
            importer, imported = (
                room(found.importer, folder),
                room(found.imported, folder),
            )
            if importer != imported:
                graph.setdefault(importer, {}).setdefault(imported, []).append(found)
    return graph


def knots(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """The rooms that import each other around a circle, in groups (Tarjan's)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for other in graph.get(node, {}):
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return sorted(found)


def circle_in(knot: list[str], graph: dict[str, dict[str, list[Import]]]) -> list[str]:
    """The shortest circle from the knot's first room back to it: ``[a, b, ..., a]``."""
    start = knot[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(graph.get(node, {})):
                if other == start:
                    back = [node]
                    while back[-1] != start:
                        back.append(came_from[back[-1]])
                    return [*reversed(back), start]
                if other in knot and other not in came_from:
                    came_from[other] = node
                    following.append(other)
        frontier = following
    raise AssertionError(f"no circle in {knot}")  # pragma: no cover


def circles(folder: str, paths: list[Path], root: Path = ROOT) -> list[str]:
    """Each circle between the rooms of ``folder``, told with the imports that make it."""
    graph = {
        importer: kept
        for importer, rooms in room_graph(folder, paths, root).items()
        if (kept := without_allowed(rooms))
    }
    told = []
    for knot in knots(graph):
        circle = circle_in(knot, graph)
        steps = []
        for importer, imported in itertools.pairwise(circle):
            first = graph[importer][imported][0]
            steps.append(
                f"  {importer} -> {imported} "
                f"({first.path.relative_to(root)}:{first.line} imports {first.imported})"
            )
        told.append(
            f"{' -> '.join(circle)} (a knot of {len(knot)} rooms: {', '.join(knot)}):\n"
            + "\n".join(steps)
        )
    return told


def paths_of(folder: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / Path(*folder.split("."))).rglob("*.py"))


@functools.cache
def package_graph(folder: str) -> dict[str, dict[str, list[Import]]]:
    """The rooms of ``folder`` in this repository, read once."""
    return room_graph(folder, paths_of(folder))


@pytest.mark.parametrize("folder", folders())
def test_no_circle_between_the_rooms_of_a_folder(folder: str) -> None:
    found = circles(folder, paths_of(folder))
    assert found == [], (
        f"rooms of {folder} (its modules and folders) that import each other around "
        f"a circle:\n" + "\n".join(found) + "\nBreak each circle: move what both need "
        "down into the lower one (a value, or a protocol the upper one fulfils), let "
        "the lower one offer a hook that the upper one registers with, or compose "
        "the two where they are used. An import inside a function or under "
        "TYPE_CHECKING is still an import. Or list the import in ALLOWED_CIRCLES "
        "with the reason."
    )


def without_allowed(rooms: dict[str, list[Import]]) -> dict[str, list[Import]]:
    """The imports to other rooms, less :data:`ALLOWED_CIRCLES`; rooms left empty go."""
    kept = {
        imported: [i for i in found if (i.importer, i.imported) not in ALLOWED_CIRCLES]
        for imported, found in rooms.items()
    }
    return {imported: found for imported, found in kept.items() if found}


def shared_folder(one: str, other: str) -> str:
    """The innermost folder that holds both modules."""
    shared = []
    for mine, theirs in zip(one.split("."), other.split("."), strict=False):
        if mine != theirs:
            break
        shared.append(mine)
    return ".".join(shared)


def test_every_allowed_circle_still_closes_one() -> None:
    # An entry whose import is gone, or no longer closes a circle, would let a new
    # circle through unnoticed: remove it.
    stale = []
    for importer, imported in ALLOWED_CIRCLES:
        folder = shared_folder(importer, imported)
        graph = package_graph(folder)
        ends = room(importer, folder), room(imported, folder)
        exists = any(
            (i.importer, i.imported) == (importer, imported)
            for i in graph.get(ends[0], {}).get(ends[1], [])
        )
        if not exists or not any(set(ends) <= set(knot) for knot in knots(graph)):
            stale.append((importer, imported))
    assert stale == [], f"ALLOWED_CIRCLES entries that close no circle: {stale}"


#: Deliberate circles: (file, source) pairs written under a tmp_path tree, and the
#: circle the test must find in the folder, told from its first room.
DELIBERATE = {
    "between two rooms, one import in a function": (
        {
            "celery_outbox/__init__.py": "",
            "celery_outbox/states.py": "from .store.types import Claimed\n",
            "celery_outbox/store/__init__.py": "",
            "celery_outbox/store/types.py": (
                "def claimed():\n    from ..states import State\n"
            ),
        },
        "celery_outbox",
        ["celery_outbox.states", "celery_outbox.store", "celery_outbox.states"],
    ),
    "inside a folder, one import under TYPE_CHECKING": (
        {
            "celery_outbox/__init__.py": "",
            "celery_outbox/events/__init__.py": "",
            "celery_outbox/events/delivery.py": "from . import held\n",
            "celery_outbox/events/held.py": "from .registry import Registry\n",
            "celery_outbox/events/registry.py": (
                "import typing\nif typing.TYPE_CHECKING:\n"
                "    from celery_outbox.events.delivery import deliver\n"
            ),
        },
        "celery_outbox.events",
        [
            "celery_outbox.events.delivery",
            "celery_outbox.events.held",
            "celery_outbox.events.registry",
            "celery_outbox.events.delivery",
        ],
    ),
    "in bench/, through the driver": (
        {
            "bench/__init__.py": "",
            "bench/run.py": "def main():\n    from bench.inbox import bench_inbox\n",
            "bench/inbox.py": "from bench.run import BenchError\n",
        },
        "bench",
        ["bench.inbox", "bench.run", "bench.inbox"],
    ),
}


@pytest.mark.parametrize("case", DELIBERATE)
def test_a_deliberate_circle_is_found(case: str, tmp_path: Path) -> None:
    files, folder, circle = DELIBERATE[case]
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    (found,) = circles(folder, paths_of(folder, tmp_path), tmp_path)
    assert found.startswith(f"{' -> '.join(circle)} ("), found
