"""Part 12 of ``make bench``: how late a scheduled task is published after its ETA.

The driver sends ``bench.noop`` with countdowns from 3 s on, one every
``SPACING`` seconds, so that the relay (``python -m django outbox relay``, a
subprocess, polling every 1 s) is idle between two ETAs and must wake for each.
Every task's ETA is beyond ``CELERY_OUTBOX_SCHEDULE_AFTER`` (lowered to 1 s here),
so each waits in the outbox. A consumer in this process reads the run's queue and
notes when each message arrives; the figure is that moment minus the message's
``eta`` header, both on this machine's wall clock. Every task must arrive exactly
once, or the part fails.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench import env
from bench.harness import ROOT, BenchError, child_env, outbox_count, percentile

#: Seconds between two ETAs: longer than the relay's adaptive poll needs to reach
#: its ceiling (1 s), so each ETA finds it idle.
SPACING = 1.5
#: The first ETA, after the relay is up.
FIRST = 3.0
STARTUP_TIMEOUT = 60.0


@dataclass(frozen=True)
class ScheduledSizes:
    """Tasks per broker and round, and rounds (the brokers take turns)."""

    tasks: int
    rounds: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> ScheduledSizes:
        sizes = cls(6, 1) if quick else cls(20, 1)
        if repeats is None:
            return sizes
        return dataclasses.replace(sizes, rounds=max(1, repeats))


class Arrivals:
    """A kombu consumer on a thread: when each message of the run's queue arrived."""

    def __init__(self, kind: str) -> None:
        from django.conf import settings
        from kombu import Connection

        self.times: dict[str, float] = {}
        self.etas: dict[str, float] = {}
        self.count = 0
        self._connection = Connection(env.broker_url(kind), connect_timeout=10)
        self._queue = settings.CELERY_TASK_QUEUES[0]
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_message(self, body: Any, message: Any) -> None:
        arrived = time.time()
        headers = message.headers or {}
        task_id = str(headers.get("id", ""))
        self.count += 1
        self.times.setdefault(task_id, arrived)
        eta = headers.get("eta")
        if eta:
            self.etas[task_id] = dt.datetime.fromisoformat(eta).timestamp()
        message.ack()

    def _run(self) -> None:
        with self._connection.Consumer(
            [self._queue], callbacks=[self._on_message], accept=["json"]
        ):
            self._ready.set()
            while not self._stop.is_set():
                try:
                    self._connection.drain_events(timeout=0.2)
                except TimeoutError:
                    continue

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the bench consumer never started")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._connection.release()


def start_relay(kind: str) -> subprocess.Popen[bytes]:

    environ = child_env(OUTBOX_BENCH_BROKER=kind)
    environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    relay = subprocess.Popen(
        [sys.executable, "-m", "django", "outbox", "relay", "--poll-interval", "1"],
        cwd=ROOT,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return relay


def measure(kind: str, tasks: int, late: list[float]) -> None:
    """One round on one broker: ``tasks`` scheduled sends; adds each one's lateness."""
    from django.db import transaction
    from django.test.utils import override_settings

    from bench.celery import noop
    from celery_outbox.models import RelayHeartbeat

    arrivals = Arrivals(kind)
    arrivals.start()
    earlier = set(RelayHeartbeat.objects.values_list("id", flat=True))
    relay = start_relay(kind)
    try:
        # Up once a heartbeat row of its own is there: the first ETA must find it
        # running (an earlier relay's row may still be there).
        up_by = time.monotonic() + STARTUP_TIMEOUT
        while set(RelayHeartbeat.objects.values_list("id", flat=True)) <= earlier:
            if relay.poll() is not None or time.monotonic() > up_by:
                raise BenchError(f"{kind}: the relay did not start")
            time.sleep(0.1)
        sent: list[str] = []
        with override_settings(CELERY_OUTBOX_SCHEDULE_AFTER=1.0):
            for number in range(tasks):
                with transaction.atomic():
                    result = noop.apply_async(
                        (number,), countdown=FIRST + number * SPACING
                    )
                sent.append(result.id)
        deadline = time.monotonic() + FIRST + tasks * SPACING + STARTUP_TIMEOUT
        while len(arrivals.times) < tasks and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # a duplicate would show by now
    finally:
        relay.terminate()
        try:
            relay.wait(30)
        except subprocess.TimeoutExpired:
            relay.kill()
        arrivals.stop()
    if sorted(arrivals.times) != sorted(sent) or arrivals.count != tasks:
        raise BenchError(
            f"{kind}: {arrivals.count} arrivals for {tasks} scheduled tasks "
            f"({len(set(sent) - set(arrivals.times))} missing); outbox holds "
            f"{outbox_count()} rows"
        )
    late.extend(
        (arrivals.times[task_id] - arrivals.etas[task_id]) * 1000 for task_id in sent
    )


def bench_scheduled(quick: bool, repeats: int | None) -> str:
    """Both brokers, taking turns, ``repeats`` rounds; returns the rendered table."""
    sizes = ScheduledSizes.pick(quick, repeats)
    samples: dict[str, list[float]] = {"amqp": [], "redis": []}
    for _ in range(sizes.rounds):
        for kind, late in samples.items():
            measure(kind, sizes.tasks, late)
    return render(sizes, samples)


def render(sizes: ScheduledSizes, samples: dict[str, list[float]]) -> str:

    lines = [
        f"13. scheduled tasks: published - ETA, ms; {sizes.tasks} tasks x "
        f"{sizes.rounds} per broker, ETAs {SPACING:.2f} s apart, `outbox relay` "
        f"(poll interval 1 s) as a subprocess, load {os.getloadavg()[0]:.1f}",
    ]
    names = {"amqp": "RabbitMQ", "redis": "Redis"}
    for kind, late in samples.items():
        ordered = sorted(late)
        lines.append(
            f"  {names[kind]:<10} p50 {percentile(ordered, 50):6.1f}  "
            f"p99 {percentile(ordered, 99):6.1f}  max {ordered[-1]:6.1f}  "
            f"min {ordered[0]:6.1f}  mean {statistics.fmean(ordered):6.1f}  "
            f"(n={len(ordered)})"
        )
    return "\n".join(lines)
