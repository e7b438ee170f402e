"""Run the support matrix (noxfile.py) on a pool of slots, then the serial tests alone.

    python scripts/matrix.py [--jobs N]

The sessions tagged ``newest``, ``oldest`` and ``contract`` share ``--jobs`` slots
(default ``OUTBOX_MATRIX_JOBS``, else 3): the newest first (it is the longest: the
whole suite, itself on pytest-xdist), then the others, each taking the next free
slot. Most of a session's time is spent waiting on databases, brokers and the relay
and worker processes it starts, so a two-core machine runs more than two at once.
Then the sessions tagged ``serial`` (the fault tests, which stop RabbitMQ and the
databases every other session uses) run alone.

Each session's output goes to ``build/matrix/<session>.log`` and is printed whole
when the session ends, so that parallel sessions never interleave their lines. Every
session runs even when another failed; any failure fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "matrix"
#: The tags of the sessions that share the slots, and of those that run alone after.
POOLED = ("newest", "oldest", "contract")
ALONE = "serial"

_print_lock = threading.Lock()


def sessions(nox: str) -> list[dict[str, object]]:
    """Every session nox lists, with its tags (``nox -l --json``)."""
    listed = subprocess.run(
        [nox, "-l", "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    found: list[dict[str, object]] = json.loads(listed.stdout)
    return found


def tagged(found: list[dict[str, object]], *tags: str) -> list[str]:
    """The sessions carrying any of ``tags``, in nox's order."""
    return [
        str(s["session"])
        for s in found
        if set(tags) & set(s.get("tags", []))  # type: ignore[arg-type]
    ]


def run_session(nox: str, session: str) -> int:
    """``nox -s session``, its output kept in a log and printed once it ended."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / (re.sub(r"[^A-Za-z0-9.]+", "-", session).strip("-") + ".log")
    started = time.monotonic()
    with log.open("wb") as out:
        status = subprocess.run(
            [nox, "-s", session], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    seconds = time.monotonic() - started
    verdict = "ok" if status == 0 else f"FAILED (exit {status})"
    with _print_lock:
        sys.stdout.write(f"\n===== {session}: {verdict} in {seconds:.0f} s =====\n")
        sys.stdout.write(log.read_text(errors="replace"))
        sys.stdout.flush()
    return status


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("OUTBOX_MATRIX_JOBS", "3")),
        help="sessions at once (default: $OUTBOX_MATRIX_JOBS, else 3)",
    )
    parser.add_argument("--nox", default=str(Path(sys.executable).parent / "nox"))
    args = parser.parse_args(argv)
    found = sessions(args.nox)
    pooled = tagged(found, *POOLED)
    alone = tagged(found, ALONE)
    print(
        f"matrix: {len(pooled)} sessions on {args.jobs} slots, then {len(alone)} alone",
        flush=True,
    )
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        statuses = list(pool.map(lambda s: run_session(args.nox, s), pooled))
    statuses += [run_session(args.nox, s) for s in alone]
    failed = [
        s for s, status in zip(pooled + alone, statuses, strict=True) if status != 0
    ]
    if failed:
        print("matrix: failed: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
