"""Parts 16 and 17 of ``make bench``: a flow's limits per key, beside the same calls
with no flow (issue #38's two scenarios per key).

One relay (``python -m django outbox relay``) and prefork workers run on the bench's
PostgreSQL database and the run's RabbitMQ queue (settings
``bench.flow_keys_settings``, in a child process: ``python -m bench.flow_keys``).
Every call is ``task.apply_async((tag, seconds), flow_key=key)``; the control calls
``bench.ordered``, which no flow covers (stock FIFO publishing), the flowed mode the
same calls of a task of a flow. Each run of a task appends its tag, its process and
its start and end (the machine's monotonic clock) to a Redis list
(:data:`bench.celery.RUNS_KEY`). Every task must run exactly once, and the outbox
must be empty afterwards (no row left waiting for a slot).

* ``cap`` (part 16): one worker of 4 processes; 3 keys x 12 tasks of 0.3-0.5 s
  (the same durations every run), one transaction per key, key after key. Flowed:
  ``bench.capped``, flow ``cap`` of ``"running": 2``. The figures: the most tasks of
  one key running at once (from the recorded starts and ends) and the seconds from
  the first commit to the last end.
* ``fair`` (part 17): two workers of 2 processes; a noisy key commits 6,000 tasks of
  5 ms in one transaction, a quiet key 20 three seconds after that commit. Flowed:
  ``bench.fair``, flow ``fair`` of ``"queued": 8`` (``OUTBOX_BENCH_FAIR_QUEUED``).
  The figures: the quiet tasks' latency from their commit to their start (p50, p95,
  max) and the noisy key's drain (its commit to its last task's end).

The modes take turns, ``--repeats`` rounds (by default ``cap`` 2, ``fair`` 1). The cost of the
flow machinery for tasks with no flow is part 2 and part 10, run before and after
(docs/benchmarks.md, parts 16 and 17).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.harness import BenchError, Brokers, child_env, child_json, percentile
from bench.strict_stack import part_env, running, warm_up

SETTINGS = "bench.flow_keys_settings"
CHILD_TIMEOUT = 900.0
#: How long one run may take before the part fails.
RUN_TIMEOUT = 300.0
#: The control and the flowed task of each scenario.
TASKS = {
    "cap": {"FIFO": "bench.ordered", "running 2": "bench.capped"},
    "fair": {"FIFO": "bench.ordered", "queued": "bench.fair"},
}


@dataclass(frozen=True)
class Run:
    """One recorded run of a task: its key, its start and its end."""

    key: str
    start: float
    end: float


@dataclass(frozen=True)
class Scenario:
    """The workers and the calls of one scenario."""

    workers: int
    concurrency: int
    keys: tuple[str, ...]
    tasks: int
    rounds: int


def scenario(name: str, quick: bool, repeats: int | None) -> Scenario:
    """``cap``: 3 keys x 12 on one worker of 4; ``fair``: 6,000 noisy tasks (1,500
    with ``--quick``) and 20 quiet ones on two workers of 2."""
    if name == "cap":
        return Scenario(1, 4, ("a", "b", "c"), 12, repeats or (1 if quick else 2))
    return Scenario(2, 2, ("noisy", "quiet"), 1_500 if quick else 6_000, repeats or 1)


# -- the processes -------------------------------------------------------------


def stack(brokers: Brokers, shape: Scenario) -> contextlib.AbstractContextManager[None]:
    """A relay and the scenario's workers, running until the block ends."""
    return running(
        brokers,
        "bench-flow-keys-",
        [part_env(OUTBOX_BENCH_BROKER="amqp")],
        shape.workers,
        lambda: warm_up(brokers),
        shape.concurrency,
    )


def send(task: str, key: str, calls: Sequence[tuple[str, float]]) -> float:
    """Commit ``calls`` of ``task`` with ``flow_key=key`` in one transaction; when
    the commit returned (monotonic)."""
    from django.db import transaction

    from bench.celery import app

    sender = app.tasks[task]
    options: dict[str, Any] = {"flow_key": key}
    with transaction.atomic():
        for tag, seconds in calls:
            sender.apply_async((tag, seconds), **options)
    return time.monotonic()


def collect(brokers: Brokers, expected: int) -> list[Run]:
    """The runs once ``expected`` are recorded; each tag exactly once, and the
    outbox empty (no row left waiting for a slot)."""
    from bench.celery import RUNS_KEY
    from bench.strict import outbox_rows

    deadline = time.monotonic() + RUN_TIMEOUT
    while (count := int(brokers.redis.llen(RUNS_KEY))) < expected:
        if time.monotonic() > deadline:
            raise BenchError(f"{count} of {expected} tasks ran in {RUN_TIMEOUT:.0f} s")
        time.sleep(0.1)
    time.sleep(0.5)  # a duplicate run would land now
    lines = [
        raw.decode() if isinstance(raw, bytes) else str(raw)
        for raw in brokers.redis.lrange(RUNS_KEY, 0, -1)
    ]
    brokers.redis.delete(RUNS_KEY)
    tags = [line.split(" ")[0] for line in lines]
    if len(tags) != expected or len(set(tags)) != expected:
        raise BenchError(f"{len(tags)} runs of {len(set(tags))} tasks, not {expected}")
    left = outbox_rows()
    if left:
        raise BenchError(f"{left} rows left in the outbox after the run")
    runs = []
    for line in lines:
        tag, _, start, end = line.split(" ")
        runs.append(Run(tag.split(":")[1], float(start), float(end)))
    return runs


def most_at_once(runs: Sequence[Run]) -> int:
    """The most of ``runs`` running at the same moment (an end before a start at
    the same instant)."""
    edges = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs])
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


# -- part 16: the cap per key --------------------------------------------------


def cap_durations(shape: Scenario) -> list[float]:
    """Each key's task durations, 0.3-0.5 s, the same in every run and key."""
    rng = random.Random(38)
    return [0.3 + 0.2 * rng.random() for _ in range(shape.tasks)]


def run_cap(
    brokers: Brokers, shape: Scenario, mode: str, number: int
) -> dict[str, Any]:
    """One run of the cap scenario in ``mode``: its figures."""
    task = TASKS["cap"][mode]
    sleeps = cap_durations(shape)
    first = 0.0
    for key in shape.keys:
        calls = [(f"{number}:{key}:{n}", sleeps[n]) for n in range(shape.tasks)]
        committed = send(task, key, calls)
        first = first or committed
    runs = collect(brokers, len(shape.keys) * shape.tasks)
    by_key = {key: [r for r in runs if r.key == key] for key in shape.keys}
    return {
        "mode": mode,
        "most_of_a_key": max(most_at_once(rows) for rows in by_key.values()),
        "most_at_once": most_at_once(runs),
        "seconds": max(r.end for r in runs) - first,
        "work": sum(sleeps) * len(shape.keys),
    }


# -- part 17: the fair share ---------------------------------------------------

#: The quiet key commits this long after the noisy key's commit returned.
QUIET_AFTER = 3.0
QUIET_TASKS = 20
#: Each task's sleep in the fair share scenario.
SHORT = 0.005


def run_fair(
    brokers: Brokers, shape: Scenario, mode: str, number: int
) -> dict[str, Any]:
    """One run of the fair share scenario in ``mode``: its figures."""
    task = TASKS["fair"][mode]
    noisy, quiet = shape.keys
    noisy_calls = [(f"{number}:{noisy}:{n}", SHORT) for n in range(shape.tasks)]
    quiet_calls = [(f"{number}:{quiet}:{n}", SHORT) for n in range(QUIET_TASKS)]
    noisy_at = send(task, noisy, noisy_calls)
    time.sleep(max(0.0, noisy_at + QUIET_AFTER - time.monotonic()))
    quiet_at = send(task, quiet, quiet_calls)
    runs = collect(brokers, shape.tasks + QUIET_TASKS)
    waits = sorted(r.start - quiet_at for r in runs if r.key == quiet)
    noisy_runs = [r for r in runs if r.key == noisy]
    return {
        "mode": mode,
        "quiet_p50": percentile(waits, 50),
        "quiet_p95": percentile(waits, 95),
        "quiet_max": waits[-1],
        "noisy_seconds": max(r.end for r in noisy_runs) - noisy_at,
        "noisy_rate": shape.tasks / (max(r.end for r in noisy_runs) - noisy_at),
        "all_seconds": max(r.end for r in runs) - noisy_at,
    }


RUNNERS = {"cap": run_cap, "fair": run_fair}


def measure(name: str, shape: Scenario) -> dict[str, Any]:
    """The scenario's modes, taking turns, ``shape.rounds`` times."""
    from django.core.management import call_command

    from bench import env
    from bench.flow_keys_settings import QUEUED
    from bench.inbox import server_version

    env.setup_django()
    call_command("migrate", verbosity=0)
    brokers = Brokers()
    results: list[dict[str, Any]] = []
    with stack(brokers, shape):
        for number in range(shape.rounds):
            for mode in TASKS[name]:
                results.append(RUNNERS[name](brokers, shape, mode, number))
    return {
        "server": server_version("postgresql"),
        "queued": QUEUED,
        "runs": results,
    }


# -- the tables ----------------------------------------------------------------


def render_cap(shape: Scenario, found: dict[str, Any]) -> str:
    lines = [
        f"16. flow keys, the cap: {len(shape.keys)} keys x {shape.tasks} tasks of "
        f"0.3-0.5 s sent key after key, one relay, a prefork worker x "
        f"{shape.concurrency}, RabbitMQ, {found['server']}; no flow (FIFO) against "
        f"the flow 'cap' of running 2 per key"
    ]
    for mode in TASKS["cap"]:
        runs = [run for run in found["runs"] if run["mode"] == mode]
        seconds = ", ".join(f"{run['seconds']:.2f}" for run in runs)
        lines.append(
            f"    {mode:<10} most of one key at once: "
            f"{max(r['most_of_a_key'] for r in runs)}   most at once: "
            f"{max(r['most_at_once'] for r in runs)}   first commit to last end: "
            f"{seconds} s (the bodies: {runs[0]['work'] / shape.concurrency:.2f} s "
            f"on {shape.concurrency} processes)"
        )
    return "\n".join(lines)


def render_fair(shape: Scenario, found: dict[str, Any]) -> str:
    lines = [
        f"17. flow keys, the fair share: {shape.tasks:,} tasks of "
        f"{SHORT * 1000:.0f} ms of one key, {QUIET_TASKS} of another committed "
        f"{QUIET_AFTER:.0f} s later, one relay, {shape.workers} prefork workers x "
        f"{shape.concurrency}, RabbitMQ, {found['server']}; no flow (FIFO) against "
        f"the flow 'fair' of queued {found['queued']} per key"
    ]
    for mode in TASKS["fair"]:
        for run in (r for r in found["runs"] if r["mode"] == mode):
            label = mode if mode == "FIFO" else f"queued {found['queued']}"
            lines.append(
                f"    {label:<10} quiet key, commit to start: p50 "
                f"{run['quiet_p50']:.2f} s, p95 {run['quiet_p95']:.2f} s, max "
                f"{run['quiet_max']:.2f} s   noisy key drained in "
                f"{run['noisy_seconds']:.1f} s ({run['noisy_rate']:.0f} /s)"
            )
    return "\n".join(lines)


def run_part(name: str, quick: bool, repeats: int | None) -> str:
    """Run one scenario in a child process (its own settings); its table."""
    shape = scenario(name, quick, repeats)
    args = ["--scenario", name, "--rounds", str(shape.rounds)]
    args += ["--quick"] if quick else []
    environ = child_env(DJANGO_SETTINGS_MODULE=SETTINGS)
    found: dict[str, Any] = child_json(
        "bench.flow_keys", args, environ, CHILD_TIMEOUT, f"the flow keys' {name} part"
    )
    return (render_cap if name == "cap" else render_fair)(shape, found)


def bench_cap(quick: bool, repeats: int | None) -> str:
    """Part 16: the cap per key, beside FIFO."""
    return run_part("cap", quick, repeats)


def bench_fair(quick: bool, repeats: int | None) -> str:
    """Part 17: the fair share between keys, beside FIFO."""
    return run_part("fair", quick, repeats)


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flow_keys")
    parser.add_argument("--scenario", choices=sorted(TASKS), required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    shape = scenario(args.scenario, args.quick, args.rounds)
    print(json.dumps(measure(args.scenario, shape)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
