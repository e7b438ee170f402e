"""The processes of the strict ordering part (``bench.strict``): a relay and workers.

Every process reads the settings the part runs under (``bench.strict_settings``,
with the vendor in ``OUTBOX_BENCH_STRICT_VENDOR``), so the relay, the workers and the
driver share one database.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench import env
from bench.harness import ROOT, BenchError, Brokers, Child, child_env

WORKERS = 2
CONCURRENCY = 2
STARTUP_TIMEOUT = 60.0


def part_env(**extra: str) -> dict[str, str]:
    """A child's environment, with the settings module this process runs under."""
    return child_env(
        DJANGO_SETTINGS_MODULE=os.environ.get(
            "DJANGO_SETTINGS_MODULE", "bench.strict_settings"
        ),
        **extra,
    )


class Worker:
    """A ``celery worker`` of the bench app (prefork, ``concurrency`` processes);
    its output goes to a log file."""

    def __init__(self, number: int, logs: Path, concurrency: int = CONCURRENCY) -> None:
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
            str(concurrency),
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
                env=part_env(),
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
def running(
    brokers: Brokers,
    prefix: str,
    relays: Sequence[dict[str, str]],
    workers: int,
    warm: Callable[[], object],
    concurrency: int = CONCURRENCY,
) -> Iterator[None]:
    """Relays (one per environment in ``relays``) and ``workers`` workers, warmed up
    by ``warm``, running until the block ends; the broker's queue emptied around it.
    On a :class:`BenchError` the workers' last lines are printed."""
    brokers.amqp_purge()
    with tempfile.TemporaryDirectory(prefix=prefix) as logs:
        children = [Child(["-m", "django", "outbox", "relay"], e) for e in relays]
        started: list[Worker] = []
        try:
            started = [
                Worker(n, Path(logs), concurrency) for n in range(1, workers + 1)
            ]
            wait_for_workers(started)
            warm()
            yield
        except BenchError:
            for worker in started:
                print(f"--- {worker.hostname}\n{worker.tail()}", file=sys.stderr)
            raise
        finally:
            for worker in started:
                worker.quit()
            for child in children:
                child.stop(terminate=True)
            for worker in started:
                worker.wait_or_kill()
            with contextlib.suppress(Exception):  # keep the error that ended the run
                brokers.amqp_purge()


def stack(brokers: Brokers) -> contextlib.AbstractContextManager[None]:
    """A relay (recording its publishes) and the workers, running until the block ends."""
    relay = part_env(OUTBOX_BENCH_BROKER="amqp", **{env.PUBLISHED_ENV: "1"})
    return running(brokers, "bench-strict-", [relay], WORKERS, lambda: warm_up(brokers))


def warm_up(brokers: Brokers) -> None:
    """One unkeyed task through the relay and a worker; then empty records."""
    from django.db import transaction

    from bench.celery import PUBLISHED_KEY, RUNS_KEY, ordered

    with transaction.atomic():
        ordered.delay("warm", 0.0)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not brokers.redis.llen(RUNS_KEY):
        if time.monotonic() > deadline:
            raise BenchError("the warm-up task did not run within 60 s")
        time.sleep(0.1)
    brokers.redis.delete(RUNS_KEY, PUBLISHED_KEY)
