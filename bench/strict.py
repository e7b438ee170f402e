"""Part 10 of ``make bench``: strict ordered tasks through real Celery workers.

One relay (``python -m django outbox relay``) and two prefork workers of
concurrency 2 (``celery -A bench.celery worker``) run on one database and the run's
RabbitMQ queue (:mod:`bench.strict_stack`). The driver enqueues KEYS x TASKS calls
of ``bench.ordered`` (a random sleep of 0-40 ms, the same durations in every run),
interleaved across keys, 50 per transaction, while the relay and the workers are
already running:

* ``strict``: ``ordering="strict"``: a key's next task is published once the
  previous one finished on a worker;
* ``publish order``: the same calls with ``ordering_key`` alone.

The two take turns, ``rounds`` times, on PostgreSQL (the relay woken by
LISTEN/NOTIFY) and then on MariaDB (the relay polls), each database in a child
process of its own (``python -m bench.strict --vendor ...``, settings
``bench.strict_settings``).

Each run of the task appends its tag, its process and when it started and ended to a
Redis list (:data:`bench.celery.RUNS_KEY`), so the figure is tasks / (the last run's
end - the end of the first commit), on the machine's monotonic clock. The relay
appends when it published each message (:data:`bench.celery.PUBLISHED_KEY`): the
**hand-off** of a strict key is the time from the end of one task to the publish of
the key's next one (the worker's report, the relay's wake-up, claim, publish and
settlement). The median time a worker process spends between two tasks (from one's
end to the next one's start) shows what each task costs beyond its body. Every task
must have run exactly once; in strict mode a key's runs must be in order (the run
fails on a single violation) and the outbox must be empty afterwards. For publish
order the runs out of order are counted, not checked: several worker processes run
a key's messages in any order.

The default size, 60 keys x 10 tasks (the issue's workload), keeps the part near a
minute per database on a 2-core machine; ``OUTBOX_BENCH_STRICT_KEYS``,
``OUTBOX_BENCH_STRICT_TASKS`` and ``OUTBOX_BENCH_STRICT_VENDORS`` (comma-separated)
change it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import env
from bench.harness import BenchError, Brokers, child_env, child_json, median, percentile
from bench.strict_stack import CONCURRENCY, WORKERS, stack

#: The longest random task duration (seconds); durations are uniform from 0.
MAX_SECONDS = 0.04
PER_TRANSACTION = 50
#: How long one run may take before the part fails.
RUN_TIMEOUT = 150.0
CHILD_TIMEOUT = 900.0
MODES = ("strict", "publish order")
VENDORS = {"postgresql": "PostgreSQL", "mysql": "MariaDB"}


@dataclass(frozen=True)
class StrictSizes:
    """Keys, tasks per key, and how many runs of each mode (taking turns)."""

    keys: int
    tasks: int
    rounds: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> StrictSizes:
        """60 x 10 in 3 rounds: the issue's workload, about a minute per database."""
        keys, tasks, rounds = (20, 5, 1) if quick else (60, 10, 3)
        return cls(
            int(os.environ.get("OUTBOX_BENCH_STRICT_KEYS", keys)),
            int(os.environ.get("OUTBOX_BENCH_STRICT_TASKS", tasks)),
            max(1, repeats or rounds),
        )

    @property
    def total(self) -> int:
        return self.keys * self.tasks


@dataclass(frozen=True)
class Run:
    """One recorded run of the task."""

    tag: str
    pid: int
    start: float
    end: float


@dataclass(frozen=True)
class RunResult:
    """One run of one mode."""

    mode: str
    tasks: int
    #: End of the first commit to the end of the last task run.
    seconds: float
    #: End of the first commit to the end of the last commit.
    enqueue_seconds: float
    #: Runs of a key recorded after a run of a later task of that key.
    violations: int
    #: Median time (ms) a worker process spent between two of its tasks.
    gap_ms: float
    #: Median of the messages ready in the queue while the tasks ran.
    ready: float
    #: Strict mode: ms from the end of a key's task to the publish of its next one.
    handoffs_ms: list[float]

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds


# -- one run -------------------------------------------------------------------


def durations(sizes: StrictSizes) -> dict[tuple[int, int], float]:
    """The sleep of task ``n`` of key ``k``: the same in every run."""
    rng = random.Random(20)
    return {
        (k, n): rng.random() * MAX_SECONDS
        for n in range(sizes.tasks)
        for k in range(sizes.keys)
    }


def enqueue(
    sizes: StrictSizes, prefix: str, strict: bool, sleeps: dict[tuple[int, int], float]
) -> tuple[float, float, dict[str, str]]:
    """Every call, keys interleaved; when the first and the last commit ended, and
    each call's tag by its task id."""
    from django.db import transaction

    from bench.celery import ordered

    calls = [(k, n) for n in range(sizes.tasks) for k in range(sizes.keys)]
    ends: list[float] = []
    tags: dict[str, str] = {}
    for start in range(0, len(calls), PER_TRANSACTION):
        with transaction.atomic():
            for k, n in calls[start : start + PER_TRANSACTION]:
                options: dict[str, Any] = {
                    "ordering_key": f"{prefix}:{k}",
                    "ordering": "strict" if strict else None,
                }
                tag = f"{prefix}:{k}:{n}"
                result = ordered.apply_async((tag, sleeps[(k, n)]), **options)
                tags[result.id] = tag
        ends.append(time.monotonic())
    return ends[0], ends[-1], tags


def collect(brokers: Brokers, expected: int) -> tuple[list[Run], float]:
    """The recorded runs, in the order Redis appended them, once ``expected`` are in,
    and the median of the queue's ready messages sampled meanwhile."""
    from bench.celery import RUNS_KEY

    deadline = time.monotonic() + RUN_TIMEOUT
    count = 0
    ready: list[float] = []
    while time.monotonic() < deadline:
        count = int(brokers.redis.llen(RUNS_KEY))
        if count >= expected:
            break
        ready.append(brokers.amqp_count())
        time.sleep(0.2)
    else:
        raise BenchError(f"{count} of {expected} tasks ran within {RUN_TIMEOUT:.0f} s")
    time.sleep(0.5)  # a duplicate run would land now
    runs = []
    for raw in brokers.redis.lrange(RUNS_KEY, 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        tag, pid, start, end = text.split(" ")
        runs.append(Run(tag, int(pid), float(start), float(end)))
    brokers.redis.delete(RUNS_KEY)
    return runs, median(ready or [0.0])


def published(brokers: Brokers, tags: dict[str, str]) -> dict[str, float]:
    """When the relay published each of this run's messages, by tag (the first time)."""
    from bench.celery import PUBLISHED_KEY

    found: dict[str, float] = {}
    for raw in brokers.redis.lrange(PUBLISHED_KEY, 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        task_id, at = text.split(" ")
        tag = tags.get(task_id)
        if tag is not None and tag not in found:
            found[tag] = float(at)
    brokers.redis.delete(PUBLISHED_KEY)
    return found


def handoffs(runs: Sequence[Run], publishes: dict[str, float]) -> list[float]:
    """Per key and step: ms from the end of task n to the publish of task n + 1."""
    ends = {run.tag: run.end for run in runs}
    found = []
    for tag, at in publishes.items():
        prefix, key, number = tag.rsplit(":", 2)
        before = ends.get(f"{prefix}:{key}:{int(number) - 1}")
        if before is not None:
            found.append((at - before) * 1000)
    return found


def check(runs: Sequence[Run], sizes: StrictSizes) -> int:
    """Each task ran once; returns the runs recorded after a later task of their key."""
    found: dict[int, list[int]] = defaultdict(list)
    for run in runs:
        _, key_text, number = run.tag.rsplit(":", 2)
        found[int(key_text)].append(int(number))
    every = list(range(sizes.tasks))
    wrong = {
        k: sorted(found.get(k, []))
        for k in range(sizes.keys)
        if sorted(found.get(k, [])) != every
    }
    if wrong or len(found) != sizes.keys:
        first = next(iter(wrong.items()), None)
        raise BenchError(
            f"{len(wrong)} keys did not run each task exactly once (key, runs: {first})"
        )
    return sum(
        1 for numbers in found.values() for a, b in itertools.pairwise(numbers) if b < a
    )


def gap_ms(runs: Sequence[Run]) -> float:
    """Median time from the end of one task to the start of the next in one process."""
    by_process: dict[int, list[Run]] = defaultdict(list)
    for run in runs:
        by_process[run.pid].append(run)
    gaps = [
        (b.start - a.end) * 1000
        for own in by_process.values()
        for a, b in itertools.pairwise(sorted(own, key=lambda r: r.start))
    ]
    return median(gaps)


def outbox_rows() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM celery_outbox_message")
        return int(cursor.fetchone()[0])


def empty_outbox() -> None:
    """Delete every outbox row and dead letter (on either database)."""
    from django.db import connection

    with connection.cursor() as cursor:
        for table in ("celery_outbox_message", "celery_outbox_deadletter"):
            cursor.execute(f"DELETE FROM {table}")


def run_once(
    sizes: StrictSizes, brokers: Brokers, mode: str, round_number: int
) -> RunResult:
    strict = mode == "strict"
    prefix = f"{'s' if strict else 'p'}{round_number}"
    first, last, tags = enqueue(sizes, prefix, strict, durations(sizes))
    runs, ready = collect(brokers, sizes.total)
    publishes = published(brokers, tags)
    violations = check(runs, sizes)
    if strict and violations:
        raise BenchError(f"strict mode: {violations} runs out of their key's order")
    deadline = time.monotonic() + 10
    while outbox_rows() and time.monotonic() < deadline:
        time.sleep(0.1)
    if outbox_rows():
        raise BenchError(f"{outbox_rows()} rows left in the outbox after the run")
    return RunResult(
        mode=mode,
        tasks=sizes.total,
        seconds=max(run.end for run in runs) - first,
        enqueue_seconds=last - first,
        violations=violations,
        gap_ms=gap_ms(runs),
        ready=ready,
        handoffs_ms=handoffs(runs, publishes) if strict else [],
    )


# -- one database, in a child process ------------------------------------------


def measure(vendor: str, sizes: StrictSizes) -> dict[str, Any]:
    """Both modes, taking turns, on this process's database: the runs as plain data."""
    from django.core.management import call_command

    from bench.inbox import ensure_database, server_version

    env.setup_django()
    ensure_database(vendor)
    call_command("migrate", verbosity=0)
    brokers = Brokers()
    empty_outbox()
    runs: list[RunResult] = []
    try:
        with stack(brokers):
            for number in range(sizes.rounds):
                for mode in MODES:
                    runs.append(run_once(sizes, brokers, mode, number))
    finally:
        empty_outbox()
    return {
        "vendor": vendor,
        "server": server_version(vendor),
        "runs": [dataclasses.asdict(run) for run in runs],
    }


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.strict")
    parser.add_argument("--vendor", choices=sorted(VENDORS), required=True)
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    args = parser.parse_args(argv)
    result = measure(args.vendor, StrictSizes(args.keys, args.tasks, args.rounds))
    print(json.dumps(result), flush=True)
    return 0


def run_child(vendor: str, sizes: StrictSizes) -> dict[str, Any]:
    args = ["--vendor", vendor]
    for name in ("keys", "tasks", "rounds"):
        args += [f"--{name}", str(getattr(sizes, name))]
    environ = child_env(
        DJANGO_SETTINGS_MODULE="bench.strict_settings",
        OUTBOX_BENCH_STRICT_VENDOR=vendor,
    )
    found: dict[str, Any] = child_json(
        "bench.strict", args, environ, CHILD_TIMEOUT, f"the strict part on {vendor}"
    )
    return found


# -- the part ------------------------------------------------------------------


def bench_strict(quick: bool, repeats: int | None, brokers: Brokers) -> str:
    """Run both modes on each database (a child process each) and render the table."""
    sizes = StrictSizes.pick(quick, repeats)
    wanted = os.environ.get("OUTBOX_BENCH_STRICT_VENDORS", ",".join(VENDORS))
    results = [run_child(v.strip(), sizes) for v in wanted.split(",") if v.strip()]
    return render(sizes, results)


def render(sizes: StrictSizes, results: Sequence[dict[str, Any]]) -> str:
    busy = sum(durations(sizes).values()) / (WORKERS * CONCURRENCY)
    lines = [
        f"10. strict ordering: {sizes.keys} keys x {sizes.tasks} tasks "
        f"({sizes.total:,}), task durations 0-{MAX_SECONDS * 1000:.0f} ms, one relay, "
        f"{WORKERS} prefork workers x {CONCURRENCY}, RabbitMQ; tasks/s from the "
        f"first commit to the last run, median of {sizes.rounds} rounds taking turns",
        f"  (the tasks' own sleeps take {busy:.1f} s on {WORKERS * CONCURRENCY} "
        f"processes: at most {sizes.total / busy:,.0f} tasks/s)",
    ]
    for result in results:
        lines.extend(render_vendor(result))
    return "\n".join(lines)


def render_vendor(result: dict[str, Any]) -> list[str]:
    by_mode: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    for raw in result["runs"]:
        run = RunResult(**raw)
        by_mode[run.mode].append(run)
    lines = [f"  {VENDORS[result['vendor']]} {result['server']}"]
    for mode, runs in by_mode.items():
        violations = max(r.violations for r in runs)
        order = (
            "0 order violations (checked)"
            if mode == "strict"
            else f"{violations} runs out of key order (not checked)"
        )
        lines.append(
            f"    {mode:<14} {median([r.rate for r in runs]):>8,.0f} /s  "
            f"{median([r.seconds for r in runs]):6.1f} s (enqueued in "
            f"{median([r.enqueue_seconds for r in runs]):.1f} s; "
            f"{median([r.gap_ms for r in runs]):.1f} ms between a process's tasks, "
            f"{median([r.ready for r in runs]):,.0f} ready in the queue)  {order}"
        )
    pairs = zip(by_mode["strict"], by_mode["publish order"], strict=True)
    ratio = median([s.rate / p.rate for s, p in pairs])
    handoff = sorted(h for r in by_mode["strict"] for h in r.handoffs_ms)
    lines.append(
        f"    strict / publish order: {ratio:.0%} (median of the rounds' ratios)   "
        f"hand-off, a task's end to its key's next publish: p50 "
        f"{percentile(handoff, 50):.1f} ms, p99 {percentile(handoff, 99):.1f} ms "
        f"(n = {len(handoff):,})"
    )
    return lines


if __name__ == "__main__":
    sys.exit(child_main())
