"""The events part end to end: real workers handle what a real relay publishes.

For one broker the driver starts a relay (``python -m django outbox relay``) and one
Celery worker per service of ``bench.events_services`` (threads pool, 4 threads),
all with ``bench.events_settings``, then:

* **handled/s**: fires ``order.created`` in transactions of ``PER_COMMIT``, then
  again all in one transaction (a burst, which the subscribers, not the firing, bound),
  and times from the first commit returning to the last event each service's
  subscriber ran (subscribers record the monotonic clock; all processes share the
  machine's). Every fired event must be handled by both services, or the run fails;
  copies handled twice are counted.
* **retry delay error**: fires ``probe.retry`` events whose subscriber fails three
  times in each service, then succeeds; the delays between a probe's attempts are
  compared with the steps 1, 2 and 4 s. RabbitMQ holds the retries in TTL queues,
  Redis leaves them to the database (outbox rows the relay publishes when due).

Every wait has a deadline; every process is stopped (SIGTERM, then SIGKILL) and
everything declared under the run's exchange is deleted at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import env
from bench.events_records import HANDLED, PROBED, Records, service_name
from bench.harness import ROOT, BenchError, child_env

#: Each service's subscribers: (service, its patterns).
E2E_SERVICES = (
    ("billing", ("order.*", "probe.retry")),
    ("shipping", ("order.created", "probe.retry")),
)
#: Retry steps (``bench.events_settings``): 1, 2 and 4 s.
STEPS = 3
#: Events per transaction when firing.
PER_COMMIT = 100
#: Threads of each service's worker.
CONCURRENCY = 4
#: How long a process may take to come up, and the subscribers to finish (s).
STARTUP_TIMEOUT = 60.0
HANDLE_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class E2ESizes:
    """Events fired end to end, and probes fired for the retry delays."""

    events: int
    probes: int

    @classmethod
    def pick(cls, quick: bool) -> E2ESizes:
        """The sizes of a full run, or of ``--quick``."""
        return cls(300, 2) if quick else cls(1_000, 3)


@dataclass(frozen=True)
class Handled:
    """One round of events fired to both services and handled by both."""

    #: Events per transaction (all of them: one burst).
    per_commit: int
    #: From the first commit to the last, and from the last to the last handled (s).
    fired: float
    lag: float
    #: Handled/s of each service, and copies/s of both.
    per_service: dict[str, float]
    overall: float
    #: Copies a service handled more than once.
    duplicates: int


@dataclass(frozen=True)
class E2EResult:
    """One broker's figures: rounds of handled events, retry delays."""

    rounds: list[Handled]
    #: (step, measured delay in s) of every probe's retries, in every service.
    delays: list[tuple[int, float]]

    def errors(self) -> list[tuple[float, float]]:
        """(error in s, error in % of the step) of every delay."""
        return [
            (delay - 2**step, (delay - 2**step) * 100 / 2**step)
            for step, delay in self.delays
        ]


class Process:
    """A subprocess of this part; its output goes to a log file, shown on failure."""

    def __init__(
        self, name: str, args: list[str], environ: dict[str, str], logs: Path
    ) -> None:

        self.name = name
        self.terminated = False
        self.log = logs / f"{name}.log"
        with self.log.open("wb") as handle:
            self.proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        """Everything the process wrote so far."""
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        """Wait until the log holds ``text``; BenchError on exit or timeout."""

        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                raise BenchError(
                    f"events: {self.name} did not say {text!r} (exit "
                    f"{self.proc.poll()}):\n{self.output()[-3000:]}"
                )
            time.sleep(0.05)

    def terminate(self) -> None:
        """Send SIGTERM once, without waiting."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            self.proc.terminate()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT: this process only."""
        self.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)


def wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; BenchError at the deadline."""

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise BenchError(
                f"events: timed out after {timeout:.0f} s waiting for {what}"
            )
        time.sleep(0.05)


def run_broker(kind: str, retries: str, exchange: str, sizes: E2ESizes) -> E2EResult:
    """Start the relay and the services on ``kind``, measure, stop; the figures.

    Call it with the driver's settings overridden to the same exchange and retries.
    """

    environ = child_env(
        DJANGO_SETTINGS_MODULE="bench.events_settings",
        OUTBOX_BENCH_BROKER=kind,
        OUTBOX_BENCH_EVENTS_EXCHANGE=exchange,
        OUTBOX_BENCH_EVENTS_RETRIES=retries,
    )
    records = Records(exchange)
    shop = _shop(kind)
    with tempfile.TemporaryDirectory(prefix="bench-events-") as logs:
        processes: list[Process] = []
        try:
            with _failing_with_logs(processes):
                _start(processes, environ, exchange, Path(logs))
                _warm_up(shop, records)
                result = _measure(shop, records, sizes)
                wait(_outbox_empty, HANDLE_TIMEOUT, "the relay to empty the outbox")
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.stop()
            records.forget()
            tasks = tuple(
                f"{exchange}:{service_name(name)}:tasks" for name, _ in E2E_SERVICES
            )
            forget(shop.app, kind, exchange, _topologies(kind), tasks)
    return result


@dataclass(frozen=True)
class Shop:
    """The firing app of one broker and its two events."""

    app: Any
    order_created: Any
    probe_retry: Any


def _shop(kind: str) -> Shop:
    """The firing app on ``kind``, with ``order.created`` and ``probe.retry``."""
    from celery_outbox import OutboxCelery

    app = OutboxCelery(f"bench-shop-e2e-{kind}", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.conf.update(broker_url=env.broker_url(kind))

    @app.event("order.created")
    def order_created(order_id: int, total: str) -> None:
        """An order was committed."""

    @app.event("probe.retry")
    def probe_retry(number: int) -> None:
        """Fails in each service's subscriber STEPS times, then succeeds."""

    return Shop(app, order_created, probe_retry)


@contextlib.contextmanager
def _failing_with_logs(processes: list[Process]) -> Iterator[None]:
    """On a failure, print the end of every process's log before it goes."""
    try:
        yield
    except BaseException:
        for process in processes:
            print(f"--- {process.name}:\n{process.output()[-3000:]}", file=sys.stderr)
        raise


def _start(
    processes: list[Process], environ: dict[str, str], exchange: str, logs: Path
) -> None:
    processes.append(
        Process("relay", ["-m", "django", "outbox", "relay"], environ, logs)
    )
    workers = dict(environ, OUTBOX_BENCH_BROKER_HEARTBEAT="2")
    for name, _ in E2E_SERVICES:
        service = service_name(name)
        args = [
            "-m", "celery", "-A", f"bench.events_services:{name}", "worker",
            "--pool", "threads", "--concurrency", str(CONCURRENCY),
            "-Q", f"{exchange}:{service}:tasks",
            "--hostname", f"{service}-{env.RUN_ID}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
            "-l", "warning",
        ]  # fmt: skip
        processes.append(Process(service, args, workers, logs))
    for process in processes[1:]:
        process.wait_for(f"events: service {process.name} consumes", STARTUP_TIMEOUT)


def _warm_up(shop: Shop, records: Records) -> None:
    """One event through the relay and both workers: everything is running."""
    from django.db import transaction

    with transaction.atomic():
        shop.order_created(-1, "0.00")
    for name, _ in E2E_SERVICES:
        service = service_name(name)
        wait(
            lambda: records.count(service, HANDLED) > 0,  # noqa: B023
            STARTUP_TIMEOUT,
            f"{service} to handle the warm-up event",
        )
        records.clear(service, HANDLED)


def _measure(shop: Shop, records: Records, sizes: E2ESizes) -> E2EResult:
    services = [service_name(name) for name, _ in E2E_SERVICES]
    rounds = [
        _handle(shop, records, services, sizes.events, per_commit)
        for per_commit in (PER_COMMIT, sizes.events)
    ]
    delays = _probe(shop, records, services, sizes.probes)
    return E2EResult(rounds, delays)


def _handle(
    shop: Shop, records: Records, services: list[str], events: int, per_commit: int
) -> Handled:
    """Fire ``events`` in transactions of ``per_commit``; wait until both services
    handled them all; handled/s from the first commit returning."""
    from django.db import transaction

    for service in services:
        records.clear(service, HANDLED)
    started = 0.0
    for first in range(0, events, per_commit):
        with transaction.atomic():
            for number in range(first, min(first + per_commit, events)):
                shop.order_created(number, "9.90")
        started = started or time.monotonic()  # the first commit returned
    committed = time.monotonic()
    wait(
        lambda: all(records.count(s, HANDLED) >= events for s in services),
        HANDLE_TIMEOUT,
        f"both services to handle {events:,} events",
    )
    per_service: dict[str, float] = {}
    duplicates = 0
    last = started
    for service in services:
        entries = records.read(service, HANDLED)
        ran = Counter(number for number, _ in entries)
        if set(ran) != set(range(events)):
            raise BenchError(f"events: {service} handled other events than fired")
        duplicates += sum(ran.values()) - len(ran)
        finished = max(at for _, at in entries)
        per_service[service] = events / (finished - started)
        last = max(last, finished)
    overall = events * len(services) / (last - started)
    return Handled(
        per_commit,
        committed - started,
        last - committed,
        per_service,
        overall,
        duplicates,
    )


def _probe(
    shop: Shop, records: Records, services: list[str], probes: int
) -> list[tuple[int, float]]:
    """Fire ``probes`` failing events; (step, delay) between each one's attempts."""
    from django.db import transaction

    with transaction.atomic():
        for number in range(probes):
            shop.probe_retry(number)
    attempts = probes * (STEPS + 1)
    wait(
        lambda: all(records.count(s, PROBED) >= attempts for s in services),
        sum(2**step for step in range(STEPS)) + HANDLE_TIMEOUT,
        f"{probes} probes to be retried {STEPS} times in each service",
    )
    delays: list[tuple[int, float]] = []
    for service in services:
        starts: dict[int, list[float]] = defaultdict(list)
        for number, at in records.read(service, PROBED):
            starts[number].append(at)
        for times in starts.values():
            pairs = itertools.pairwise(sorted(times))
            delays += [(step, b - a) for step, (a, b) in enumerate(pairs)]
    return delays


def _outbox_empty() -> bool:
    from celery_outbox.models import OutboxMessage

    return not OutboxMessage.objects.exists()


def _topologies(kind: str) -> list[Any]:
    """The two services' topologies, for the current settings."""
    from celery_outbox.conf import get_settings
    from celery_outbox.events.modes import resolve
    from celery_outbox.events.topology import ServiceTopology

    settings = get_settings()
    retries = resolve(settings.events_retries, kind)  # kombu names them alike
    return [
        ServiceTopology(settings, service_name(name), patterns, retries)
        for name, patterns in E2E_SERVICES
    ]


def forget(
    app: Any,
    kind: str,
    exchange: str,
    topologies: list[Any],
    queues: tuple[str, ...] = (),
) -> None:
    """Delete what was declared under ``exchange``: on Redis every key naming it, on
    RabbitMQ the topologies' queues and exchanges and ``queues`` (with the exchanges
    of their names, which Celery declares for a ``-Q`` queue)."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        if kind == "redis":
            client = channel.client
            for key in client.scan_iter(f"*{exchange}*"):
                client.delete(key)
            return
        exchanges = {exchange, *queues}
        for topology in topologies:
            exchanges.add(topology.recover.name)
            for queue in topology.all_queues():
                channel.queue_delete(queue.name)
                if queue.exchange is not None and queue.exchange.name:
                    exchanges.add(queue.exchange.name)
                exchanges.update(
                    each.exchange.name
                    for each in queue.bindings or ()
                    if each.exchange is not None
                )
        for queue_name in queues:
            channel.queue_delete(queue_name)
        for name in sorted(exchanges):
            channel.exchange_delete(name)
