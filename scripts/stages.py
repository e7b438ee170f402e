"""Where ``make test``'s time goes: each stage timed, watched, and shown in one table.

    python scripts/stages.py run NAME -- COMMAND...   run COMMAND as the stage NAME
    python scripts/stages.py add NAME SECONDS         record a stage timed elsewhere
    python scripts/stages.py report                   the table of this run
    python scripts/stages.py keep                     this run's figures become the recorded ones

Every stage of ``make test`` (the venv, lint, the fast tests, the package check, each
nox session's install and tests) writes one file into ``$OUTBOX_STAGES`` (default
``build/stages``): its name, wall time and exit status. The test runs add the tests
they ran and their slowest ones (``tests/conftest.py``). ``report`` prints the stages
in the order they started, beside the figure recorded for each in
``.ci/stages.json``, then the ten slowest tests of the whole run.

Each test file has a budget too (:data:`FILE_BUDGET` seconds of its tests' time in
one session, the serial session aside): the report names every file over it, and
``report`` fails the run when a file took more than :data:`FILE_FACTOR` times its
recorded figure plus :data:`FILE_SLACK` (or, with no figure yet, that many times the
budget): a test file that grows past its share is seen the day it does, not when the
whole run misses CI's limit.

A stage that runs far longer than its recorded figure is a hang, not a slow day: it
is stopped (its whole process group) at ``LIMIT_FACTOR`` times its figure plus
``LIMIT_SLACK`` seconds, with a message naming the stage, so that CI fails with a
reason instead of running into its own limit. A stage with no recorded figure has no
limit of its own.

Standard library only: nox runs it with each session's Python.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The figures of the last measured clean-clone run (``keep`` writes them).
RECORDED = ROOT / ".ci" / "stages.json"
#: A stage is stopped past this many times its recorded figure, plus the slack.
LIMIT_FACTOR = 3.0
LIMIT_SLACK = 600.0
#: How many of the slowest tests the report lists.
SLOWEST = 10
#: Seconds of test time one test file may take in one session (not the serial one).
FILE_BUDGET = 120.0
#: A file fails the run past this many times its recorded figure, plus the slack.
FILE_FACTOR = 2.0
FILE_SLACK = 30.0
#: Stages whose files have no budget: they run alone, and stop servers.
UNBUDGETED = ("serial",)


def stages_dir() -> Path:
    """Where this run's stage files go (``$OUTBOX_STAGES``, else ``build/stages``)."""
    return Path(os.environ.get("OUTBOX_STAGES") or ROOT / "build" / "stages")


def file_name(name: str) -> str:
    """A file name for the stage ``name`` (its words joined by dashes)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-") + ".json"


def recorded(part: str = "stages") -> dict[str, float]:
    """Stage name (or, with ``part="files"``, test file) -> seconds, as last kept."""
    try:
        found = json.loads(RECORDED.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in found.get(part, {}).items()}


def file_times(tests: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(stage, test file) -> seconds of its tests, for the budgeted stages."""
    times: dict[tuple[str, str], float] = {}
    for summary in tests:
        if any(word in summary["stage"] for word in UNBUDGETED):
            continue
        for path, seconds in summary.get("files", {}).items():
            key = (summary["stage"], path)
            times[key] = times.get(key, 0.0) + seconds
    return times


def file_limit(path: str, figures: dict[str, float]) -> float:
    """Seconds past which ``path`` fails the run."""
    figure = figures.get(path, FILE_BUDGET)
    return figure * FILE_FACTOR + FILE_SLACK


def limit_for(
    name: str,
    figures: dict[str, float] | None = None,
    slack: float = LIMIT_SLACK,
) -> float | None:
    """Seconds after which the stage ``name`` counts as hung (None: no figure)."""
    figure = (recorded() if figures is None else figures).get(name)
    if figure is None:
        return None
    return figure * LIMIT_FACTOR + slack


def write(
    name: str, seconds: float, status: int, started: float, cpu: float | None = None
) -> None:
    """Record one stage of this run (``cpu``: the processor seconds its processes used)."""
    folder = stages_dir()
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name,
        "seconds": seconds,
        "status": status,
        "started": started,
        "cpu": cpu,
    }
    (folder / file_name(name)).write_text(json.dumps(record))


def run(
    name: str,
    command: Sequence[str],
    figures: dict[str, float] | None = None,
    slack: float = LIMIT_SLACK,
) -> int:
    """Run ``command`` as the stage ``name``; its exit status (1 when stopped as hung).

    ``figures`` are the recorded ones (default: ``.ci/stages.json``).
    """
    figures = recorded() if figures is None else figures
    limit = limit_for(name, figures, slack)
    started = time.time()
    clock = time.monotonic()
    used = _children_cpu()
    env = dict(os.environ, OUTBOX_STAGE=name)
    # A process group of its own: a hung stage is stopped with all it started.
    child = subprocess.Popen(list(command), env=env, start_new_session=True)

    def forward(signum: int, _frame: Any) -> None:
        _signal_group(child.pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    try:
        status = child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _stop_group(child)
        seconds = time.monotonic() - clock
        write(name, seconds, 124, started)
        print(
            f"\nstages: '{name}' was stopped after {seconds:.0f} s: its recorded figure "
            f"is {figures[name]:.0f} s and its limit {limit:.0f} s "
            f"({LIMIT_FACTOR} x the figure + {slack:.0f} s). A stage this far "
            "over its figure is taken for a hang; its output above shows where it was. "
            "If it really got slower, measure it and update .ci/stages.json "
            "(python scripts/stages.py keep).",
            file=sys.stderr,
            flush=True,
        )
        return 1
    write(name, time.monotonic() - clock, status, started, _children_cpu() - used)
    return status


def _children_cpu() -> float:
    """Processor seconds (user and system) of the waited-for descendants so far.

    The stage's command, the relays and workers its tests started and stopped: not
    the database and broker servers, whose share is the wall time's to show.
    """
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def _stop_group(child: subprocess.Popen[bytes]) -> None:
    _signal_group(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=20)
    except subprocess.TimeoutExpired:
        _signal_group(child.pid, signal.SIGKILL)
        child.wait()


def load() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """This run's stages (by start) and test-run summaries (``tests/conftest.py``)."""
    stages, tests = [], []
    folder = stages_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        found = json.loads(path.read_text())
        (tests if "tests" in found else stages).append(found)
    stages.sort(key=lambda s: s["started"])
    return stages, tests


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}:{rest:02d}"


def report() -> str:
    """The table of this run's stages, the test files over their budget, then the
    slowest tests (a line starting ``FAILED:`` for a file past its limit)."""
    stages, tests = load()
    figures = recorded()
    counts: dict[str, dict[str, int]] = {}
    for summary in tests:
        into = counts.setdefault(summary["stage"], {})
        for outcome, n in summary["tests"].items():
            into[outcome] = into.get(outcome, 0) + n
    rows = [("stage", "wall", "cpu", "recorded", "tests", "status")]
    for stage in stages:
        figure = figures.get(stage["name"])
        summary = counts.get(stage["name"])
        rows.append(
            (
                stage["name"],
                _clock(stage["seconds"]),
                _clock(stage["cpu"]) if stage.get("cpu") is not None else "-",
                _clock(figure) if figure is not None else "-",
                _tests_cell(summary),
                "ok" if stage["status"] == 0 else f"exit {stage['status']}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["", "== where make test's time went (scripts/stages.py) =="]
    for n, row in enumerate(rows):
        cells = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i])
            for i in range(len(row))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if stages:
        first = min(s["started"] for s in stages)
        last = max(s["started"] + s["seconds"] for s in stages)
        busy = sum(s["seconds"] for s in stages)
        cpu = sum(s.get("cpu") or 0.0 for s in stages)
        lines.append(
            f"total: {_clock(last - first)} from the first stage's start to the last "
            f"one's end ({_clock(busy)} of stage time, as sessions overlap; "
            f"{_clock(cpu)} of processor time, servers not counted)"
        )
    times = file_times(tests)
    file_figures = recorded("files")
    over = sorted(
        (
            (seconds, stage, path)
            for (stage, path), seconds in times.items()
            if seconds > FILE_BUDGET
        ),
        reverse=True,
    )
    if over:
        lines += ["", f"== test files over their budget of {FILE_BUDGET:g} s =="]
        for seconds, stage, path in over:
            figure = file_figures.get(path)
            said = f"recorded {figure:.0f} s" if figure is not None else "no figure"
            lines.append(f"{seconds:7.1f} s  {path}  [{stage}] ({said})")
    failed = [
        (seconds, stage, path)
        for (stage, path), seconds in sorted(times.items())
        if seconds > file_limit(path, file_figures)
    ]
    for seconds, stage, path in failed:
        lines.append(
            f"FAILED: {path} took {seconds:.0f} s in {stage}, past "
            f"{file_limit(path, file_figures):.0f} s ({FILE_FACTOR:g} x its figure "
            f"+ {FILE_SLACK:g} s): make it cheaper, move it to the serial session, "
            f"or, if the cost is right, record the new figure "
            f"(python scripts/stages.py keep)"
        )
    slow = sorted(
        ((t, row) for t in tests for row in t.get("slowest", [])),
        key=lambda pair: -pair[1][1],
    )[:SLOWEST]
    if slow:
        lines += ["", f"== the {SLOWEST} slowest tests of the run =="]
        for summary, (nodeid, seconds) in slow:
            lines.append(f"{seconds:7.1f} s  {nodeid}  [{summary['stage']}]")
    return "\n".join(lines)


def _tests_cell(outcomes: dict[str, int] | None) -> str:
    if outcomes is None:
        return ""
    cell = str(outcomes.get("passed", 0))
    extra = [
        f"{outcomes[k]} {k}"
        for k in ("failed", "error", "skipped", "xfailed", "xpassed")
        if outcomes.get(k)
    ]
    return cell + (f" ({', '.join(extra)})" if extra else "")


def keep() -> None:
    """Write this run's stage and test file figures into ``.ci/stages.json``."""
    stages, tests = load()
    figures = recorded()
    figures.update({s["name"]: round(s["seconds"], 1) for s in stages})
    # A file's figure is its slowest session's in this run.
    this_run: dict[str, float] = {}
    for (_, path), seconds in file_times(tests).items():
        this_run[path] = max(round(seconds, 1), this_run.get(path, 0.0))
    files = recorded("files")
    files.update(this_run)
    RECORDED.write_text(
        json.dumps(
            {
                "stages": dict(sorted(figures.items())),
                "files": dict(sorted(files.items())),
            },
            indent=2,
        )
        + "\n"
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="stages.py", description=__doc__.split("\n")[0]
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    run_ = verbs.add_parser("run", help="run a command as a stage")
    run_.add_argument("name")
    run_.add_argument("command", nargs=argparse.REMAINDER)
    add = verbs.add_parser("add", help="record a stage timed elsewhere")
    add.add_argument("name")
    add.add_argument("seconds", type=float)
    add.add_argument("--status", type=int, default=0)
    verbs.add_parser("report", help="the table of this run")
    verbs.add_parser("keep", help="this run's figures become the recorded ones")
    verbs.add_parser("clear", help="forget this run's stages (a new run starts)")
    args = parser.parse_args(argv)
    if args.verb == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("run: give the command after --")
        return run(args.name, command)
    if args.verb == "add":
        write(args.name, args.seconds, args.status, time.time() - args.seconds)
    elif args.verb == "report":
        table = report()
        print(table)
        if any(line.startswith("FAILED:") for line in table.splitlines()):
            return 1
    elif args.verb == "keep":
        keep()
    elif args.verb == "clear":
        for path in stages_dir().glob("*.json"):
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
