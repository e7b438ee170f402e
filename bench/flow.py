"""Part 15 of ``make bench``: flow control's rate with two relays, beside stock Celery.

Two relays (``python -m django outbox relay``) and two prefork workers of
concurrency 2 run on the bench's PostgreSQL database and the run's RabbitMQ queue
(settings ``bench.flow_settings``, in a child process: ``python -m bench.flow``).
Once a warm-up task ran, the driver commits ``tasks`` calls at once of:

* ``flow``: ``bench.flowed``, covered by the flow ``bench`` of 20/s: the relays ask
  the gate what they may publish;
* ``rate_limit``: ``bench.limited``, stock Celery's ``rate_limit="20/s"``, sent
  straight to the broker (each worker holds its own 20/s: the control).

Each run of a task appends when it started (the machine's monotonic clock) to a
Redis list (:data:`bench.celery.RUNS_KEY`). The figures: the most starts in any
one-second window (the flow must hold 20), the rate from the first start to the
last, and the seconds that took. Every task must run exactly once.

The drain of tasks with no flow is part 2 (``--only drain``), run on this branch and
on the code before it (docs/benchmarks.md, part 15).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.harness import BenchError, Brokers, child_env, child_json
from bench.strict_stack import (
    CONCURRENCY,
    WORKERS,
    part_env,
    running,
)

RATE = 20
RELAYS = 2
RUN_TIMEOUT = 120.0
CHILD_TIMEOUT = 600.0
MODES = {"flow": "bench.flowed", "rate_limit": "bench.limited"}


def tasks_for(quick: bool) -> int:
    """300 calls: 15 s at 20/s (the issue's workload); 100 with ``--quick``."""
    return 100 if quick else 300


def stack(brokers: Brokers) -> contextlib.AbstractContextManager[None]:
    """Two relays and the workers, running until the block ends."""
    return running(
        brokers,
        "bench-flow-",
        [part_env(OUTBOX_BENCH_BROKER="amqp") for _ in range(RELAYS)],
        WORKERS,
        lambda: run_all(brokers, "bench.ordered", 1, "warm"),
    )


def run_all(brokers: Brokers, task: str, tasks: int, mode: str) -> list[float]:
    """Commit ``tasks`` calls of ``task`` at once; each run's start, once all ran."""
    from django.db import transaction

    from bench.celery import RUNS_KEY, app

    brokers.redis.delete(RUNS_KEY)
    with transaction.atomic():
        for number in range(tasks):
            app.send_task(task, (f"{mode}-{number}", 0.0))
    deadline = time.monotonic() + RUN_TIMEOUT
    while brokers.redis.llen(RUNS_KEY) < tasks:
        if time.monotonic() > deadline:
            raise BenchError(
                f"{mode}: {brokers.redis.llen(RUNS_KEY)} of {tasks} ran in "
                f"{RUN_TIMEOUT:.0f} s"
            )
        time.sleep(0.05)
    time.sleep(1.0)  # a duplicate would show by now
    runs = [line.decode().split() for line in brokers.redis.lrange(RUNS_KEY, 0, -1)]
    tags = [run[0] for run in runs]
    if len(set(tags)) != tasks or len(tags) != tasks:
        raise BenchError(f"{mode}: {len(tags)} runs of {len(set(tags))} tasks")
    return sorted(float(run[2]) for run in runs)


def most_in_a_second(starts: Sequence[float]) -> int:
    """The most starts in any window of one second (each start opens one)."""
    most, end = 0, 0
    for begin, start in enumerate(starts):
        while end < len(starts) and starts[end] < start + 1.0:
            end += 1
        most = max(most, end - begin)
    return most


def measure(tasks: int, rounds: int) -> dict[str, Any]:
    """Both modes, taking turns, ``rounds`` times: each run's figures."""
    from django.core.management import call_command

    from bench import env
    from bench.inbox import server_version

    env.setup_django()
    call_command("migrate", verbosity=0)
    brokers = Brokers()
    runs: list[dict[str, Any]] = []
    with stack(brokers):
        for _ in range(rounds):
            for mode, task in MODES.items():
                starts = run_all(brokers, task, tasks, mode)
                seconds = starts[-1] - starts[0]
                runs.append(
                    {
                        "mode": mode,
                        "most_in_a_second": most_in_a_second(starts),
                        "seconds": seconds,
                        "rate": (tasks - 1) / seconds if seconds else float("inf"),
                    }
                )
    return {"server": server_version("postgresql"), "tasks": tasks, "runs": runs}


def render(result: dict[str, Any]) -> str:
    lines = [
        f"15. flow control: {result['tasks']} tasks committed at once, {RELAYS} relays, "
        f"{WORKERS} prefork workers x {CONCURRENCY}, RabbitMQ, {result['server']}; "
        f"the flow 'bench' of {RATE}/s against stock Celery's rate_limit="
        f"'{RATE}/s' (per worker)"
    ]
    for mode in MODES:
        runs = [run for run in result["runs"] if run["mode"] == mode]
        most = max(run["most_in_a_second"] for run in runs)
        rates = ", ".join(f"{run['rate']:.1f}" for run in runs)
        spans = ", ".join(f"{run['seconds']:.1f}" for run in runs)
        lines.append(
            f"    {mode:<11} most starts in any 1 s: {most:>3}   first to last start: "
            f"{spans} s   rate {rates} /s   ({len(runs)} round(s))"
        )
    return "\n".join(lines)


def bench_flow(quick: bool, repeats: int | None) -> str:
    """Run the part in a child process (its own settings) and render its table."""
    args = ["--tasks", str(tasks_for(quick)), "--rounds", str(repeats or 1)]
    environ = child_env(DJANGO_SETTINGS_MODULE="bench.flow_settings")
    found: dict[str, Any] = child_json(
        "bench.flow", args, environ, CHILD_TIMEOUT, "the flow part"
    )
    return render(found)


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flow")
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.tasks, args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
