"""The package's layers hold: no room imports from a floor above its own, and no
rooms import each other around a circle. No exception.

A room is a top-level module or a first-level folder of the package; the floors,
bottom first, are :data:`FLOORS`, the one statement of the order, drawn in
``docs/explanation.md`` ("Layers"). Every import counts, at module level, inside a
function or under ``TYPE_CHECKING``. For circles, the rooms of every folder are
checked: the modules and folders right below it (in ``celery_outbox``: ``task``,
``events``, ...; in ``celery_outbox.events``: ``delivery``, ``registry``, ...), in
the package and in ``bench/``.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_outbox"

#: The floors, bottom first, and the rooms on each: the package's top-level modules
#: and first-level folders. A room imports only from its own floor and those below;
#: this is the one statement of the order (docs/explanation.md draws it).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "values",
        (
            "caches", "conf", "decoding", "durations", "envelope", "exceptions",
            "flow_limits", "ordering_options", "outcomes", "progress", "propagation",
            "queues", "redaction", "scheduling", "states", "text",
        ),
    ),
    (
        "stores",
        ("backends", "broker", "collation", "migrations", "models", "sinks", "store"),
    ),
    ("engine", ("engine",)),
    (
        "lanes",
        ("enqueue", "events", "flow", "handlers", "inbox", "ordering", "relay", "revoke"),
    ),
    ("observers", ("contrib", "metrics", "signals")),
    (
        "top",
        (
            "admin", "app", "apps", "checks", "cli", "history_admin", "inspection",
            "management", "operations", "pytest_plugin", "task", "tasks", "testing",
            # The package itself (its __init__): what a user imports first.
            "celery_outbox",
        ),
    ),
)  # fmt: skip

#: Each room's floor, by its index in :data:`FLOORS`.
FLOOR_OF = {room: index for index, (_, rooms) in enumerate(FLOORS) for room in rooms}


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


def top_room(module: str) -> str:
    """The room of ``module`` in the package: its top-level module or first-level
    folder (``celery_outbox.events.held`` is in ``events``); the package's own
    ``__init__`` is ``celery_outbox``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor_name(room: str) -> str:
    return FLOORS[FLOOR_OF[room]][0]


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
    return FLOOR_OF[top_room(found.imported)] > FLOOR_OF[top_room(found.importer)]


def rooms_of_the_package(root: Path = PACKAGE) -> set[str]:
    """The package's top-level modules and first-level folders, and itself."""
    found = {"celery_outbox"}
    for path in root.iterdir():
        if path.suffix == ".py" and path.stem != "__init__":
            found.add(path.stem)
        elif (path / "__init__.py").exists():
            found.add(path.name)
    return found


def test_every_room_has_a_floor_and_every_floor_entry_a_room() -> None:
    rooms = rooms_of_the_package()
    assert sorted(rooms - set(FLOOR_OF)) == [], (
        f"rooms with no floor: {sorted(rooms - set(FLOOR_OF))}. Put each on a floor "
        f"of FLOORS in {Path(__file__).name} (the lowest whose rooms hold all it "
        f"imports) and draw it in docs/explanation.md."
    )
    assert sorted(set(FLOOR_OF) - rooms) == [], "FLOORS names rooms that are gone"


def test_nothing_imports_upward() -> None:
    problems = []
    for path in modules():
        for found in imports_of(path):
            if upward(found):
                own, other = top_room(found.importer), top_room(found.imported)
                below = ", ".join(name for name, _ in FLOORS[: FLOOR_OF[own] + 1])
                problems.append(
                    f"{path.relative_to(ROOT)}:{found.line}: {found.importer} "
                    f"(room {own}, floor {floor_name(own)}) imports {found.imported} "
                    f"(room {other}, floor {floor_name(other)}); the {floor_name(own)} "
                    f"floor imports only from {below}. Move what it needs down (a "
                    f"value or a protocol of the lower floor, which the upper room "
                    f"fulfils), or have it handed in from above (the app, an "
                    f"observer, a hook)."
                )
    assert problems == [], "\n".join(problems)


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


def test_the_explanation_draws_every_room_on_its_floor() -> None:
    text = (ROOT / "docs" / "explanation.md").read_text()
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = {
        row.split("|")[1].strip(): set(re.findall(r"`([\w.]+)/?`", row.split("|")[2]))
        for row in section.splitlines()
        if row.startswith("| ") and row.count("|") >= 4
    }
    wrong = [
        (room, name)
        for name, rooms in FLOORS
        for room in rooms
        if room != "celery_outbox" and room not in rows.get(name, set())
    ]
    assert wrong == [], (
        f"rooms not drawn on their floor in docs/explanation.md: {wrong}"
    )


# -- circles -------------------------------------------------------------------

#: The trees whose folders hold no circle: the package, and the benchmark beside it.
TREES = (PACKAGE, ROOT / "bench")


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
    graph = room_graph(folder, paths, root)
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


@pytest.mark.parametrize("folder", folders())
def test_no_circle_between_the_rooms_of_a_folder(folder: str) -> None:
    found = circles(folder, paths_of(folder))
    assert found == [], (
        f"rooms of {folder} (its modules and folders) that import each other around "
        f"a circle:\n" + "\n".join(found) + "\nBreak each circle: move what both need "
        "down into the lower one (a value, or a protocol the upper one fulfils), let "
        "the lower one offer a hook that the upper one registers with, or compose "
        "the two where they are used. An import inside a function or under "
        "TYPE_CHECKING is still an import."
    )


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
