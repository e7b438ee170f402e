"""scripts/stages.py: make test's stages timed, a hung one stopped, the table printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "stages.py"

#: Runs one stage the way make's STAGE wrapper does, with the recorded figures and
#: the slack given on the command line: a figure of 0.1 s and a slack of 1 s stop
#: the stage after 1.3 s instead of minutes.
RUN_WITH_FIGURES = """
import json, sys
sys.path.insert(0, sys.argv[1])
import stages
figures = json.loads(sys.argv[2])
sys.exit(stages.run(sys.argv[3], sys.argv[5:], figures=figures, slack=float(sys.argv[4])))
"""


def stage(
    tmp_path: Path,
    name: str,
    command: list[str],
    figures: dict[str, float] | None = None,
    slack: float = 1.0,
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_STAGES": str(tmp_path / "stages")}
    env.pop("OUTBOX_STAGE", None)
    if figures is None:
        args = [sys.executable, str(SCRIPT), "run", name, "--", *command]
    else:
        args = [
            sys.executable,
            "-c",
            RUN_WITH_FIGURES,
            str(SCRIPT.parent),
            json.dumps(figures),
            name,
            str(slack),
            *command,
        ]
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def records(tmp_path: Path) -> dict[str, dict[str, object]]:
    found = (json.loads(p.read_text()) for p in (tmp_path / "stages").glob("*.json"))
    return {str(r["name"]): r for r in found}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stage_far_past_its_figure_is_stopped_with_all_it_started(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "grandchild.pid"
    hang = ["sh", "-c", f"sleep 120 & echo $! > {pid_file}; wait"]
    started = time.monotonic()
    done = stage(tmp_path, "3.13/6.1/5.7: tests", hang, {"3.13/6.1/5.7: tests": 0.1})
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30
    assert "'3.13/6.1/5.7: tests' was stopped after" in done.stderr
    assert "update .ci/stages.json" in done.stderr
    assert records(tmp_path)["3.13/6.1/5.7: tests"]["status"] == 124
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the stage's own children must be stopped too"


def test_a_stage_within_its_figure_or_without_one_runs_to_its_end(
    tmp_path: Path,
) -> None:
    quick = [sys.executable, "-c", "import time, sys; time.sleep(0.2); sys.exit(3)"]
    assert stage(tmp_path, "within", quick, {"within": 10.0}).returncode == 3
    assert stage(tmp_path, "unrecorded", quick).returncode == 3
    found = records(tmp_path)
    assert found["within"]["status"] == 3 and found["unrecorded"]["status"] == 3
    assert 0.2 <= float(str(found["within"]["seconds"])) < 10


def test_the_report_lists_every_stage_with_its_status_and_the_total(
    tmp_path: Path,
) -> None:
    stage(tmp_path, "venv", [sys.executable, "-c", "pass"])
    stage(tmp_path, "check: tests", [sys.executable, "-c", "raise SystemExit(2)"])
    env = {**os.environ, "OUTBOX_STAGES": str(tmp_path / "stages")}
    report = subprocess.run(
        [sys.executable, str(SCRIPT), "report"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = report.splitlines()
    venv = next(line for line in lines if line.startswith("venv "))
    failed = next(line for line in lines if line.startswith("check: tests "))
    assert venv.endswith("ok")
    assert failed.endswith("exit 2")
    assert lines.index(venv) < lines.index(failed)  # in the order they started
    assert any(line.startswith("total: ") for line in lines)


def test_a_test_file_over_its_budget_is_named_and_past_twice_its_figure_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import stages

    monkeypatch.setenv("OUTBOX_STAGES", str(tmp_path / "stages"))
    recorded = tmp_path / "stages.json"
    recorded.write_text(json.dumps({"files": {"tests/e2e/test_grown.py": 100.0}}))
    monkeypatch.setattr(stages, "RECORDED", recorded)
    folder = tmp_path / "stages"
    folder.mkdir()

    def summary(stage: str, files: dict[str, float]) -> None:
        found = {"stage": stage, "tests": {"passed": 1}, "slowest": [], "files": files}
        (folder / stages.file_name(f"tests {stage}")).write_text(json.dumps(found))

    budget = stages.FILE_BUDGET
    summary("3.13/6.1/5.7: tests", {"tests/e2e/test_big.py": budget + 5})
    summary("3.13/6.1/5.7: serial tests", {"tests/faults/test_x.py": budget * 9})
    table = stages.report()
    assert "tests/e2e/test_big.py" in table  # over the budget: named
    assert "test_x.py" not in table  # the serial session has no budget
    assert "FAILED:" not in table

    # A file with a figure fails past twice it plus the slack; one without, past
    # twice the budget plus the slack.
    summary("3.12/6.0/5.6: contract tests", {"tests/e2e/test_grown.py": 231.0})
    summary("3.11/4.2/5.5: contract tests", {"tests/e2e/test_new.py": budget * 3})
    failed = [line for line in stages.report().splitlines() if "FAILED:" in line]
    assert len(failed) == 2
    assert any("test_grown.py took 231 s" in line for line in failed)
    assert any("test_new.py" in line for line in failed)
    assert stages.main(["report"]) == 1

    # keep() records each file's slowest session of this run.
    stages.keep()
    kept = json.loads(recorded.read_text())["files"]
    assert kept["tests/e2e/test_grown.py"] == 231.0
    assert "tests/faults/test_x.py" not in kept
