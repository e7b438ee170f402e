"""Part 10 of ``make bench``: strict ordered tasks through real Celery workers.

One relay (``python -m django outbox relay``) and two prefork workers of
concurrency 2 (``celery -A bench.celery worker``) run on the bench's database and
RabbitMQ queue. The driver enqueues KEYS x TASKS calls of ``bench.ordered`` (a
random sleep of 0-50 ms, the same durations in every run), interleaved across keys,
50 per transaction, while the relay and the workers are already running:

* ``strict``: ``ordering="strict"``: a key's next task is published once the
  previous one finished on a worker;
* ``publish order``: the same calls with ``ordering_key`` alone.

Each run of the task appends its tag, its process and when it started and ended to a
Redis list (:data:`bench.celery.RUNS_KEY`), so the figure is tasks / (the last run's
end - the end of the first commit), on the machine's monotonic clock. The median
time a worker process spends between two tasks (from one's end to the next one's
start) shows what each task costs beyond its body. Every task must
have run exactly once; in strict mode a key's runs must be in order (the run fails
on a single violation) and the outbox must be empty afterwards. For publish order
the runs out of order are counted, not checked: several worker processes run a
key's messages in any order.

The default size, 200 x 10, keeps the part under a minute on a 2-core machine;
``OUTBOX_BENCH_STRICT_KEYS`` and ``OUTBOX_BENCH_STRICT_TASKS`` change it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import env
from bench.run import ROOT, BenchError, Brokers, Child, child_env, median

WORKERS = 2
CONCURRENCY = 2
#: The longest random task duration (seconds); durations are uniform from 0.
MAX_SECONDS = 0.05
PER_TRANSACTION = 50
#: How long one run may take before the part fails.
RUN_TIMEOUT = 150.0
STARTUP_TIMEOUT = 60.0
MODES = ("strict", "publish order")


@dataclass(frozen=True)
class StrictSizes:
    """Keys, tasks per key, and how many runs of each mode (taking turns)."""

    keys: int
    tasks: int
    rounds: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> StrictSizes:
        """200 x 10: the issue's 200 x 20 takes near a minute in strict mode alone."""
        keys, tasks = (40, 5) if quick else (200, 10)
        return cls(
            int(os.environ.get("OUTBOX_BENCH_STRICT_KEYS", keys)),
            int(os.environ.get("OUTBOX_BENCH_STRICT_TASKS", tasks)),
            max(1, repeats or 1),
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

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds


# -- processes -----------------------------------------------------------------


class Worker:
    """A ``celery worker`` of the bench app; its output goes to a log file."""

    def __init__(self, number: int, logs: Path) -> None:
        self.hostname = f"bench-{env.RUN_ID}-{number}@localhost"
        self.log = logs / f"worker-{number}.log"
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.celery",
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            str(CONCURRENCY),
            "-Q",
            env.QUEUE,
            "--hostname",
            self.hostname,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "warning",
        ]
        with self.log.open("wb") as handle:
            self.proc = subprocess.Popen(
                args,
                cwd=ROOT,
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                # A group of its own: the pool's processes go with it at a SIGKILL.
                start_new_session=True,
            )

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = self.log.read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def quit(self) -> None:
        """Ask for a cold shutdown (SIGQUIT): no task is running by now."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)

    def wait_or_kill(self, timeout: float = 15.0) -> None:
        """Wait for the exit; past ``timeout``, SIGKILL the worker's process group."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)


def wait_for_workers(workers: Sequence[Worker]) -> None:
    """Until every worker answers a ping (only these workers are asked)."""
    from bench.celery import app

    names = [w.hostname for w in workers]
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        dead = [w for w in workers if w.proc.poll() is not None]
        if dead:
            raise BenchError(f"a worker exited at start:\n{dead[0].tail()}")
        replies = app.control.ping(destination=names, timeout=1.0) or []
        answered = {name for reply in replies for name in reply}
        if answered >= set(names):
            return
    raise BenchError(f"workers did not answer within {STARTUP_TIMEOUT:.0f} s")


@contextlib.contextmanager
def stack(brokers: Brokers) -> Iterator[None]:
    """A relay and the workers, running until the block ends."""
    brokers.amqp_purge()
    with tempfile.TemporaryDirectory(prefix="bench-strict-") as logs:
        workers: list[Worker] = []
        relay = Child(
            ["-m", "django", "outbox", "relay"], child_env(OUTBOX_BENCH_BROKER="amqp")
        )
        try:
            workers = [Worker(n, Path(logs)) for n in range(1, WORKERS + 1)]
            wait_for_workers(workers)
            warm_up(brokers)
            yield
        except BenchError:
            for worker in workers:
                print(f"--- {worker.hostname}\n{worker.tail()}", file=sys.stderr)
            raise
        finally:
            for worker in workers:
                worker.quit()
            relay.stop(terminate=True)
            for worker in workers:
                worker.wait_or_kill()
            with contextlib.suppress(Exception):  # keep the error that ended the run
                brokers.amqp_purge()


def warm_up(brokers: Brokers) -> None:
    """One unkeyed task through the relay and a worker; then an empty record."""
    from django.db import transaction

    from bench.celery import RUNS_KEY, ordered

    with transaction.atomic():
        ordered.delay("warm", 0.0)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not brokers.redis.llen(RUNS_KEY):
        if time.monotonic() > deadline:
            raise BenchError("the warm-up task did not run within 60 s")
        time.sleep(0.1)
    brokers.redis.delete(RUNS_KEY)


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
) -> tuple[float, float]:
    """Every call, keys interleaved; when the first and the last commit ended."""
    from django.db import transaction

    from bench.celery import ordered

    calls = [(k, n) for n in range(sizes.tasks) for k in range(sizes.keys)]
    ends: list[float] = []
    for start in range(0, len(calls), PER_TRANSACTION):
        with transaction.atomic():
            for k, n in calls[start : start + PER_TRANSACTION]:
                options: dict[str, Any] = {
                    "ordering_key": f"{prefix}:{k}",
                    "ordering": "strict" if strict else None,
                }
                ordered.apply_async((f"{prefix}:{k}:{n}", sleeps[(k, n)]), **options)
        ends.append(time.monotonic())
    return ends[0], ends[-1]


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


def run_once(
    sizes: StrictSizes, brokers: Brokers, mode: str, round_number: int
) -> RunResult:
    from bench.run import outbox_count

    strict = mode == "strict"
    prefix = f"{'s' if strict else 'p'}{round_number}"
    first, last = enqueue(sizes, prefix, strict, durations(sizes))
    runs, ready = collect(brokers, sizes.total)
    violations = check(runs, sizes)
    if strict and violations:
        raise BenchError(f"strict mode: {violations} runs out of their key's order")
    deadline = time.monotonic() + 10
    while outbox_count() and time.monotonic() < deadline:
        time.sleep(0.1)
    if outbox_count():
        raise BenchError(f"{outbox_count()} rows left in the outbox after the run")
    return RunResult(
        mode=mode,
        tasks=sizes.total,
        seconds=max(run.end for run in runs) - first,
        enqueue_seconds=last - first,
        violations=violations,
        gap_ms=gap_ms(runs),
        ready=ready,
    )


# -- the part ------------------------------------------------------------------


def bench_strict(quick: bool, repeats: int | None, brokers: Brokers) -> str:
    """Run both modes (taking turns, ``repeats`` rounds) and render the table."""
    from bench.run import truncate

    sizes = StrictSizes.pick(quick, repeats)
    truncate()
    results: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    with stack(brokers):
        for number in range(sizes.rounds):
            for mode in MODES:
                results[mode].append(run_once(sizes, brokers, mode, number))
    return render(sizes, results)


def render(sizes: StrictSizes, results: dict[str, list[RunResult]]) -> str:
    busy = sum(durations(sizes).values()) / (WORKERS * CONCURRENCY)
    lines = [
        f"10. strict ordering: {sizes.keys} keys x {sizes.tasks} tasks "
        f"({sizes.total:,}), task durations 0-{MAX_SECONDS * 1000:.0f} ms, one relay, "
        f"{WORKERS} prefork workers x {CONCURRENCY}, RabbitMQ; tasks/s from the "
        f"first commit to the last run, median of {sizes.rounds}",
        f"  (the tasks' own sleeps take {busy:.1f} s on {WORKERS * CONCURRENCY} "
        f"processes: at most {sizes.total / busy:,.0f} tasks/s)",
    ]
    for mode, runs in results.items():
        rate = median([r.rate for r in runs])
        seconds = median([r.seconds for r in runs])
        enqueued = median([r.enqueue_seconds for r in runs])
        violations = max(r.violations for r in runs)
        gap = median([r.gap_ms for r in runs])
        ready = median([r.ready for r in runs])
        order = (
            "0 order violations (checked)"
            if mode == "strict"
            else f"{violations} runs out of key order (not checked)"
        )
        lines.append(
            f"  {mode:<14} {rate:>8,.0f} /s  {seconds:6.1f} s "
            f"(enqueued in {enqueued:.1f} s; {gap:.1f} ms between a process's "
            f"tasks, {ready:,.0f} ready in the queue)  {order}"
        )
    strict = median([r.rate for r in results["strict"]])
    plain = median([r.rate for r in results["publish order"]])
    lines.append(f"  strict / publish order: {strict / plain:.0%}")
    return "\n".join(lines)
