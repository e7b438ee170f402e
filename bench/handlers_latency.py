"""Part 11 of ``make bench``: from a commit to the handler outbox's receiver.

The driver emits one message of the category ``bench.latency`` per transaction,
at a steady rate, over a few shards, while a real processor
(``python -m django outbox handlers run``, a subprocess) runs. Each variant has a
processor of its own:

* ``flush on commit``: the writer wraps its transaction in
  ``outbox_context(flush=True)`` and runs the shard itself right after the commit
  (the processor polls every 1 s and takes what the flush leaves);
* ``processor only``: ``outbox_context(flush=False)``; the processor finds the
  message at its next poll (every 1 s, the default, and every 0.2 s).

The commit's time is taken by the transaction's first ``on_commit`` callback; the
receiver (registered by ``bench.apps``) appends ``"<object id> <pid> <monotonic
time>"`` to a Redis list as it starts. Both use the machine's monotonic clock.
Every message must reach the receiver exactly once, or the part fails.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench import env
from bench.harness import BenchError, Child, child_env, percentile

CATEGORY = "bench.latency"
#: The Redis list the receiver appends to; named after the run's queue, so the
#: bench's clean-up deletes it.
RUNS_KEY = f"{env.QUEUE}:handler-runs"
RATE = 30.0
SHARDS = 8
STARTUP_TIMEOUT = 60.0
#: How long the last message may take to reach its receiver.
DRAIN_TIMEOUT = 30.0


@dataclass(frozen=True)
class Variant:
    """How messages reach the receiver in one variant."""

    name: str
    flush: bool
    poll_interval: float


VARIANTS = (
    Variant("flush on commit (processor polls every 1 s)", True, 1.0),
    Variant("processor only, polling every 1 s", False, 1.0),
    Variant("processor only, polling every 0.2 s", False, 0.2),
)


@dataclass(frozen=True)
class HandlerSizes:
    """Seconds of emitting per variant and round, and rounds (variants take turns)."""

    seconds: float
    rounds: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> HandlerSizes:
        sizes = cls(3.0, 1) if quick else cls(10.0, 1)
        if repeats is None:
            return sizes
        return dataclasses.replace(sizes, rounds=max(1, repeats))


@dataclass
class Samples:
    """One variant's latencies (ms) over every round, and who ran the messages."""

    delays: list[float] = dataclasses.field(default_factory=list)
    by_writer: int = 0


# -- the receiver --------------------------------------------------------------


@functools.cache
def _redis() -> Any:
    import redis

    return redis.Redis.from_url(env.REDIS_URL, socket_timeout=30)


def record(*, object_id: str, **_: Any) -> None:
    """The receiver: note who ran the message and when, first thing."""
    at = time.monotonic()
    _redis().rpush(RUNS_KEY, f"{object_id} {os.getpid()} {at:.6f}")


def register() -> None:
    """Declare the receiver (``bench.apps`` calls it in every bench process)."""
    from celery_outbox import handlers

    handlers.receiver(CATEGORY, coalesce=False)(record)


# -- the driver ----------------------------------------------------------------


def emit_one(object_id: str, number: int, flush: bool) -> float:
    """One message in one transaction; returns the monotonic time of its commit."""
    from django.db import transaction

    from celery_outbox import handlers

    committed: list[float] = []
    with handlers.outbox_context(flush=flush), transaction.atomic():
        # The first callback: it runs as soon as COMMIT returned, before the flush.
        transaction.on_commit(lambda: committed.append(time.monotonic()))
        handlers.emit(
            CATEGORY,
            shard=("lat", number % SHARDS),
            object_id=object_id,
            payload={"n": number},
        )
    return committed[0]


def runs(expected: int, timeout: float) -> dict[str, tuple[int, float]]:
    """Object id -> (pid, monotonic time) of every run, once ``expected`` are in."""

    client = _redis()
    deadline = time.monotonic() + timeout
    while int(client.llen(RUNS_KEY)) < expected:
        if time.monotonic() > deadline:
            count = client.llen(RUNS_KEY)
            raise BenchError(f"{count} of {expected} messages reached the receiver")
        time.sleep(0.05)
    found: dict[str, tuple[int, float]] = {}
    for raw in client.lrange(RUNS_KEY, 0, -1):
        object_id, pid, stamp = raw.decode().split(" ")
        if object_id in found:
            raise BenchError(f"message {object_id} reached the receiver twice")
        found[object_id] = (int(pid), float(stamp))
    client.delete(RUNS_KEY)
    return found


def warm_up(processor_pid: int, flush: bool, tag: str) -> None:
    """One message through the processor (it is up), then a few as measured."""

    emit_one(f"{tag}-warm", 0, flush=False)
    (pid, _) = runs(1, STARTUP_TIMEOUT)[f"{tag}-warm"]
    if pid != processor_pid:
        raise BenchError("the warm-up message was run by another process")
    for number in range(5):
        emit_one(f"{tag}-warm{number}", number, flush)
    runs(5, DRAIN_TIMEOUT)


def measure(variant: Variant, seconds: float, tag: str, samples: Samples) -> None:
    """Emit at :data:`RATE` for ``seconds`` with a processor of the variant's own."""

    processor = Child(
        [
            "-m",
            "django",
            "outbox",
            "handlers",
            "run",
            "--poll-interval",
            str(variant.poll_interval),
        ],
        child_env(),
    )
    try:
        warm_up(processor.proc.pid, variant.flush, tag)
        count = int(RATE * seconds)
        committed: dict[str, float] = {}
        start = time.monotonic() + 0.05
        for number in range(count):
            pause = start + number / RATE - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            object_id = f"{tag}-{number}"
            committed[object_id] = emit_one(object_id, number, variant.flush)
        found = runs(count, DRAIN_TIMEOUT)
    finally:
        processor.stop(terminate=True)
    for object_id, at in committed.items():
        pid, ran = found[object_id]
        samples.delays.append((ran - at) * 1000)
        samples.by_writer += pid == os.getpid()


def bench_handlers(quick: bool, repeats: int | None) -> str:
    """Every variant (taking turns, ``repeats`` rounds); returns the rendered table."""
    from celery_outbox.handlers.models import HandlerMessage

    sizes = HandlerSizes.pick(quick, repeats)
    _redis().delete(RUNS_KEY)
    samples = {variant.name: Samples() for variant in VARIANTS}
    try:
        for round_number in range(sizes.rounds):
            for index, variant in enumerate(VARIANTS):
                tag = f"r{round_number}v{index}"
                measure(variant, sizes.seconds, tag, samples[variant.name])
    finally:
        HandlerMessage.objects.filter(category=CATEGORY).delete()
        _redis().delete(RUNS_KEY)
    return render(sizes, samples)


def render(sizes: HandlerSizes, samples: dict[str, Samples]) -> str:

    lines = [
        f"11. handler outboxes: commit -> receiver called, ms; {RATE:.0f} emits/s "
        f"for {sizes.seconds:.0f} s x {sizes.rounds}, one message per transaction, "
        f"{SHARDS} shards, `outbox handlers run` as a subprocess",
    ]
    for name, found in samples.items():
        delays = sorted(found.delays)
        who = (
            f"; {found.by_writer / len(delays):.0%} run by the writer"
            if found.by_writer
            else ""
        )
        lines.append(
            f"  {name:<46} p50 {percentile(delays, 50):6.1f}  "
            f"p95 {percentile(delays, 95):6.1f}  p99 {percentile(delays, 99):6.1f}  "
            f"max {delays[-1]:6.1f}  mean {statistics.fmean(delays):6.1f}  "
            f"(n={len(delays)}{who})"
        )
    return "\n".join(lines)
