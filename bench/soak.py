"""Part 12, soak: a million messages at a steady rate through one relay (PostgreSQL).

``python -m bench.soak [--count N] [--rate R] [--every S] [--autovacuum ...]``

A producer thread commits ``--rate`` messages a second (prebuilt ``bench.noop``
messages written by the enqueue's ``OutboxWriter.insert``, one transaction per 0.1 s, with the
wake-up hint as the enqueue path sends it) while one relay (``python -m bench.soak
relay``: ``build_relay`` as ``manage.py outbox relay`` builds it, its store wrapped to
time each claim and settlement) publishes them to RabbitMQ with confirms. The run's
queue is purged every few seconds, the purged counts summed, so RabbitMQ does not
grow and every message that reached it is still counted. Every ``--every`` seconds
a line: the drain rate, the claim time (p50/p99), the outbox table's and its indexes'
size and its dead tuples (``pg_stat_user_tables``), with the autovacuum runs so far.

It runs on a database of its own (``outbox_bench_soak``, or ``OUTBOX_BENCH_DB``;
``python -m bench --only soak`` uses the bench database's name with ``_soak``):
the table's size must be the soak's alone. ``--autovacuum recommended`` sets the
per-table settings docs/operations.md recommends before the run; ``default`` (the
default) resets them, so the table runs with the server's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Before bench.env reads it: the soak's table must be its own.
os.environ.setdefault("OUTBOX_BENCH_DB", "outbox_bench_soak")

from bench import env
from bench.harness import (
    ROOT,
    BenchError,
    Brokers,
    Child,
    capture_envelopes,
    child_env,
    prepare,
)
from bench.soak_table import (
    RECOMMENDED,
    Sample,
    autovacuum_settings,
    read_sizes,
    render_line,
    render_summary,
    set_autovacuum,
)

#: Rows a producer transaction carries at most (it catches up after a slow commit).
MAX_PER_COMMIT = 2_000
TICK = 0.1
#: Seconds between purges of the run's queue.
PURGE_EVERY = 5.0


@dataclass
class Timings:
    """Claim and settlement durations the relay reported, with when they arrived."""

    claims: list[tuple[float, float, int]] = field(default_factory=list)
    settles: list[tuple[float, float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, line: str) -> bool:
        """Keep a ``claim``/``settle`` line of the relay; False for any other line."""
        kind, _, rest = line.partition(" ")
        if kind not in ("claim", "settle"):
            return False
        seconds, rows = rest.split()
        with self.lock:
            target = self.claims if kind == "claim" else self.settles
            target.append((time.monotonic(), float(seconds), int(rows)))
        return True

    def window(self, since: float) -> tuple[list[float], list[float], int]:
        """Claim and settle seconds reported after ``since``, and the rows claimed."""
        with self.lock:
            claims = [s for at, s, n in self.claims if at >= since and n]
            settles = [s for at, s, _ in self.settles if at >= since]
            rows = sum(n for at, _, n in self.claims if at >= since)
        return claims, settles, rows


class Producer(threading.Thread):
    """Commits ``rate`` messages a second until ``count`` are written."""

    def __init__(self, envelopes: Sequence[Any], count: int, rate: float) -> None:
        super().__init__(name="soak-producer", daemon=True)
        self.envelopes = envelopes
        self.count = count
        self.rate = rate
        self.written = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        from django.db import connection, transaction

        from celery_outbox.store import Stores

        store = Stores("default").writer()
        started = time.monotonic()
        try:
            while self.written < self.count and not self.stop.is_set():
                due = min(self.count, int((time.monotonic() - started) * self.rate))
                n = min(due - self.written, MAX_PER_COMMIT)
                if n > 0:
                    with transaction.atomic():
                        store.insert(self._next(n), notify=True)
                    self.written += n
                self.stop.wait(TICK)
        except BaseException as exc:  # reported by the driver, which stops the run
            self.error = exc
        finally:
            connection.close()

    def _next(self, n: int) -> list[Any]:
        start = self.written % len(self.envelopes)
        picked = list(self.envelopes[start : start + n])
        while len(picked) < n:
            picked.extend(self.envelopes[: n - len(picked)])
        return picked


class TimedStore:
    """The relay's store, printing how long each claim and settlement took."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._out = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def claim(self, limit: int, lease_seconds: float, **kwargs: Any) -> Any:
        """The store's claim, timed (the prefetching thread calls it too)."""
        started = time.perf_counter()
        claim = self._store.claim(limit, lease_seconds, **kwargs)
        self._print("claim", time.perf_counter() - started, len(claim.messages))
        return claim

    def settle(self, token: str, settlement: Any) -> Any:
        """The store's settlement, timed."""
        started = time.perf_counter()
        report = self._store.settle(token, settlement)
        self._print("settle", time.perf_counter() - started, settlement.size)
        return report

    def _print(self, kind: str, seconds: float, rows: int) -> None:
        with self._out:
            sys.stdout.write(f"{kind} {seconds:.6f} {rows}\n")
            sys.stdout.flush()


def relay() -> int:
    """``python -m bench.soak relay``: one relay until SIGTERM, timing its store."""
    env.setup_django()
    from celery_outbox.cli.runner import build_relay
    from celery_outbox.conf import get_settings

    runner = build_relay(get_settings())
    runner.store = TimedStore(runner.store)  # type: ignore[assignment]
    signal.signal(signal.SIGTERM, lambda *_: runner.stop())
    print("ready", flush=True)
    runner.run()
    return 0


@dataclass
class Run:
    """The options of one soak and what it saw."""

    count: int
    rate: float
    every: float
    autovacuum: str
    samples: list[Sample] = field(default_factory=list)
    published: int = 0


def soak(run: Run) -> Run:
    """Produce, relay and sample until every message reached RabbitMQ."""
    brokers = Brokers()
    brokers.amqp_purge()
    prepare_table(run.autovacuum)
    print(autovacuum_settings(), flush=True)
    envelopes = capture_envelopes(min(run.count, 10_000))
    timings = Timings()
    relay_proc = Child(["-m", "bench.soak", "relay"], child_env())
    relay_proc.on_line = timings.add
    producer = Producer(envelopes, run.count, run.rate)
    purged = 0
    try:
        relay_proc.expect("ready", timeout=60)
        started = time.monotonic()
        producer.start()
        last = Sample.first(read_sizes(), started)
        print(render_line(None), flush=True)
        next_purge = started + PURGE_EVERY
        while True:
            time.sleep(0.2)
            if producer.error is not None:
                raise BenchError(f"the producer failed: {producer.error!r}")
            if relay_proc.proc.poll() is not None:
                raise BenchError(f"the relay exited with {relay_proc.proc.returncode}")
            now = time.monotonic()
            if now >= next_purge:
                purged += purge(brokers)
                next_purge = now + PURGE_EVERY
            # From RabbitMQ's side: a count(*) of the table every line would hold a
            # snapshot for seconds on a bloated table, and so hold back its cleanup.
            published = purged + brokers.amqp_count()
            done = published >= run.count
            if now - last.at >= run.every or done:
                counts = (producer.written, published, producer.written - published)
                window = timings.window(last.at)
                sample = last.next(now, started, counts, window, read_sizes())
                run.samples.append(sample)
                print(render_line(sample), flush=True)
                last = sample
            if done:
                break
        run.published = purged + brokers.wait_count("amqp", run.count - purged, 30)
    finally:
        producer.stop.set()
        relay_proc.stop(terminate=True)
        brokers.cleanup()
    if run.published != run.count:
        raise BenchError(f"RabbitMQ got {run.published} messages, expected {run.count}")
    left = table_rows()
    if left:
        raise BenchError(f"{left} rows left in the outbox table")
    return run


def prepare_table(autovacuum: str) -> None:
    """An empty outbox table with the chosen autovacuum settings, and fresh counters."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE celery_outbox_message, celery_outbox_deadletter")
        cursor.execute(
            "SELECT pg_stat_reset_single_table_counters(%s::regclass)",
            ["celery_outbox_message"],
        )
    set_autovacuum(autovacuum == "recommended")


def table_rows() -> int:
    """Rows in the outbox table (due or leased)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM celery_outbox_message")
        return int(cursor.fetchone()[0])


def purge(brokers: Any) -> int:
    """Empty the run's queue; how many messages it held."""
    return int(brokers.amqp.default_channel.queue_purge(env.QUEUE) or 0)


def run_soak(quick: bool) -> None:
    """``python -m bench --only soak``: the soak in a process of its own database."""
    import subprocess

    # A run id and queue of its own; the services where the parent's are, the
    # database beside the parent's (outbox_bench_soak next to outbox_bench).
    fresh = ("OUTBOX_BENCH_RUN", "OUTBOX_BENCH_QUEUE")
    environ = {k: v for k, v in os.environ.items() if k not in fresh}
    environ["OUTBOX_BENCH_DB"] = f"{env.PG_NAME}_soak"
    args = [sys.executable, "-m", "bench.soak"] + (
        ["--count", "50000"] if quick else []
    )
    subprocess.run(args, cwd=ROOT, env=environ, check=True)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the soak and print its table and summary."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        return relay()
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--count", type=int, default=1_000_000, help="messages (1,000,000)"
    )
    parser.add_argument(
        "--rate", type=float, default=2_000.0, help="messages/s (2,000)"
    )
    parser.add_argument(
        "--every", type=float, default=30.0, help="seconds per line (30)"
    )
    parser.add_argument(
        "--autovacuum",
        choices=["default", "recommended"],
        default="default",
        help=f"per-table settings: {RECOMMENDED}",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every line as JSON")
    args = parser.parse_args(argv)

    prepare()
    run = soak(Run(args.count, args.rate, args.every, args.autovacuum))
    print(render_summary(run.samples, run.count, run.published), flush=True)
    if args.json:
        data = {"run": env.RUN_ID, **asdict(run)}
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
