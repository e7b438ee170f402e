"""What every part of the benchmark shares: its errors and sizes, the statistics,
the child processes, the brokers' queues and the outbox table's fill and drain.

The driver (:mod:`bench.run`) imports each part, and each part imports this module:
never the driver back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import env

#: The repository root: subprocesses run from here so ``bench`` imports.
ROOT = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A measurement could not be trusted (lost messages, leftovers, timeouts)."""


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; ``--quick`` shrinks everything."""

    enqueue_n: int
    enqueue_repeats: int
    drain_rows: int
    drain_repeats: int
    latency_seconds: float
    raw_n: int
    raw_repeats: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> Sizes:
        sizes = (
            cls(300, 3, 4_000, 1, 4.0, 4_000, 1)
            if quick
            else cls(2_000, 5, 20_000, 3, 15.0, 20_000, 3)
        )
        if repeats is None:
            return sizes
        return dataclasses.replace(
            sizes,
            enqueue_repeats=repeats,
            drain_repeats=repeats,
            raw_repeats=repeats,
        )


# -- helpers -------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(pct / 100 * len(sorted_values) + 0.5)))
    return float(sorted_values[rank - 1])


def child_env(**extra: str) -> dict[str, str]:
    environ = dict(os.environ)
    environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p
    )
    environ.update(extra)
    return environ


def child_json(
    module: str, args: Sequence[str], environ: dict[str, str], timeout: float, what: str
) -> Any:
    """Run ``python -m module *args``: what the JSON on its last line of output holds.

    A part that needs settings of its own (another database, another app) measures
    in such a child; ``what`` names the part in the error when the child fails.
    """
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchError(
            f"{what} exited with {done.returncode}:\n{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


class Child:
    """A subprocess whose stdout lines are collected by a thread."""

    def __init__(self, args: list[str], environ: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.on_line: Callable[[str], bool] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            hook = self.on_line
            if hook is not None and hook(line):
                continue
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The next line starting with ``prefix``; fails on timeout or exit."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.proc.args!r}: no {prefix!r} in {timeout}s")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise BenchError(
                    f"{self.proc.args!r} exited ({self.proc.wait()}) before {prefix!r}"
                )
            if line.startswith(prefix):
                return line

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout: float = 20.0, *, terminate: bool = False) -> None:
        """Close stdin (or SIGTERM at once), then SIGTERM, then SIGKILL: this process only."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        first = self.proc.terminate if terminate else None
        for action in (first, self.proc.terminate, self.proc.kill):
            if action is not None and self.proc.poll() is None:
                action()
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=5)


# -- services ------------------------------------------------------------------


class Brokers:
    """Admin access to the run's RabbitMQ queue and Redis list: count, purge, delete."""

    def __init__(self) -> None:
        import redis
        from django.conf import settings
        from kombu import Connection

        self.queue_entity = settings.CELERY_TASK_QUEUES[0]
        self.amqp = Connection(env.AMQP_URL, connect_timeout=10)
        self.amqp.ensure_connection(max_retries=3)
        self.redis = redis.Redis.from_url(env.REDIS_URL, socket_timeout=30)

    def amqp_declare(self) -> None:
        self.queue_entity(self.amqp.default_channel).declare()

    def amqp_count(self) -> int:
        _, count, _ = self.amqp.default_channel.queue_declare(env.QUEUE, passive=True)
        return int(count)

    def amqp_purge(self) -> None:
        self.amqp_declare()
        self.amqp.default_channel.queue_purge(env.QUEUE)

    def redis_count(self) -> int:
        return int(self.redis.llen(env.QUEUE))

    def redis_purge(self) -> None:
        self.redis.delete(env.QUEUE)

    def count(self, kind: str) -> int:
        return self.amqp_count() if kind == "amqp" else self.redis_count()

    def purge(self, kind: str) -> None:
        self.amqp_purge() if kind == "amqp" else self.redis_purge()

    def wait_count(self, kind: str, expected: int, timeout: float = 10.0) -> int:
        """The queue length once it reaches ``expected`` (or the last one seen)."""
        deadline = time.monotonic() + timeout
        count = self.count(kind)
        while count < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            count = self.count(kind)
        return count

    def cleanup(self) -> None:
        """Delete the run's queue, exchange and Redis keys."""
        with contextlib.suppress(Exception):
            channel = self.amqp.default_channel
            channel.queue_delete(env.QUEUE)
            channel.exchange_delete(env.QUEUE)
        with contextlib.suppress(Exception):
            keys = list(self.redis.scan_iter(match=f"*{env.QUEUE}*", count=1000))
            if keys:
                self.redis.delete(*keys[:10_000])
        with contextlib.suppress(Exception):
            self.amqp.release()
        with contextlib.suppress(Exception):
            self.redis.close()


def truncate() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE celery_outbox_message, celery_outbox_deadletter, bench_benchorder"
        )


def outbox_count() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM celery_outbox_message")
        return int(cursor.fetchone()[0])


def capture_envelopes(n: int) -> list[Any]:
    """``n`` real outbox messages for ``bench.noop(i)``, built by the enqueue path.

    Celery builds and serializes each message exactly as ``delay()`` would; the
    capturing producer hands it to a list instead of the database, so tables can be
    refilled quickly and identically for every drain.
    """
    from bench.celery import app
    from celery_outbox.enqueue import CapturingProducer

    collected: list[Any] = []

    def sink(envelopes: Sequence[Any]) -> dict[str, str]:
        collected.extend(envelopes)
        return {}  # no call was refused for another task's dedup key

    producer = CapturingProducer(
        connection=app.connection_for_write(),
        default_serializer=app.conf.task_serializer,
        default_compression=app.conf.task_compression,
        sink=sink,
    )
    for number in range(n):
        app.send_task(env.TASK_NAME, args=(number,), producer=producer)
    if len(collected) != n:
        raise BenchError(f"captured {len(collected)} messages, expected {n}")
    return collected


def fill(envelopes: Sequence[Any], chunk: int = 1_000) -> None:
    """Write the messages as pending outbox rows (an empty table first)."""
    from django.db import connection, transaction

    from celery_outbox.store import Stores

    truncate()
    store = Stores("default").writer()
    with transaction.atomic():
        for start in range(0, len(envelopes), chunk):
            store.insert(envelopes[start : start + chunk])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE celery_outbox_message")
    if outbox_count() != len(envelopes):
        raise BenchError("the outbox table does not hold the rows just written")


def drain_once(
    kind: str,
    relays: int,
    envelopes: Sequence[Any],
    brokers: Brokers,
    *,
    library_only: bool = False,
) -> float:
    """Tasks per second for ``relays`` relay processes to empty a filled table.

    ``library_only``: the relays publish through py-amqp's and kombu's own code
    instead of the relay's replacements of it (see ``bench.proc``).
    """
    from bench.proc import LIBRARY_ONLY

    expected = len(envelopes)
    brokers.purge(kind)
    fill(envelopes)
    environ = child_env(OUTBOX_BENCH_BROKER=kind)
    environ[LIBRARY_ONLY] = "1" if library_only else "0"
    children = [Child(["-m", "bench.proc", "relay"], environ) for _ in range(relays)]
    try:
        for child in children:
            child.expect("ready", timeout=60)
        for child in children:
            child.send("go")
        done = [
            json.loads(child.expect("done ", timeout=300)[5:]) for child in children
        ]
        for child in children:
            if child.proc.wait(timeout=30) != 0:
                raise BenchError(f"relay exited with {child.proc.returncode}")
    finally:
        for child in children:
            child.stop()
    elapsed = max(d["end"] for d in done) - min(d["start"] for d in done)
    left = outbox_count()
    if left:
        raise BenchError(f"{kind} drain with {relays} relay(s): {left} rows left")
    count = brokers.wait_count(kind, expected)
    if count != expected:
        raise BenchError(
            f"{kind} drain with {relays} relay(s): the queue holds {count} messages, "
            f"expected {expected}"
        )
    brokers.purge(kind)
    return expected / elapsed


def verdict(ok: bool) -> str:
    return "ok" if ok else "BELOW TARGET"


def prepare() -> None:
    env.ensure_database()
    env.setup_django()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
