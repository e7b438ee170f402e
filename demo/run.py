"""The demo driver: a real relay, a real worker, orders placed and some rolled back.

Steps: recreate ``demo/var``; migrate; start ``manage.py outbox relay`` and a Celery
worker as subprocesses; place orders, each in its own ``transaction.atomic()`` that
saves the order and calls ``send_receipt.delay(order.id)``, rolling back every Nth;
wait until every committed order's receipt ran, then a little longer; print what
happened and exit 0 only if the guarantee held.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from demo.config import PACKAGE_DIR, redact, var_dir

REPO_ROOT = PACKAGE_DIR.parent
SETTINGS_MODULE = "demo.settings"


class DemoFailed(Exception):
    """The demo could not run (a process died, something timed out)."""


class Abort(BaseException):
    """SIGTERM to the driver: unwind through ``finally`` like Ctrl-C does."""


@dataclass
class Outcome:
    """What the demo placed and what the worker did with it."""

    committed: dict[str, datetime] = field(
        default_factory=dict
    )  # task id -> commit time
    rolled_back: set[str] = field(default_factory=set)  # task ids
    runs: dict[str, list[datetime]] = field(
        default_factory=dict
    )  # task id -> executions
    foreign: int = 0  # receipts of tasks this run did not send
    outbox_left: dict[str, Any] = field(default_factory=dict)

    @property
    def executed(self) -> int:
        return sum(1 for task_id in self.committed if self.runs.get(task_id))

    @property
    def never_executed(self) -> int:
        return sum(1 for task_id in self.rolled_back if not self.runs.get(task_id))

    @property
    def duplicates(self) -> int:
        return sum(len(times) - 1 for times in self.runs.values() if len(times) > 1)

    @property
    def latencies_ms(self) -> list[float]:
        return [
            (self.runs[task_id][0] - committed_at).total_seconds() * 1000
            for task_id, committed_at in self.committed.items()
            if self.runs.get(task_id)
        ]

    @property
    def held(self) -> bool:
        return (
            self.executed == len(self.committed)
            and self.never_executed == len(self.rolled_back)
            and self.duplicates == 0
        )


# -- processes ---------------------------------------------------------------------


class Child:
    """A subprocess with its output in a log file under ``demo/var``."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        env = dict(
            os.environ, DJANGO_SETTINGS_MODULE=SETTINGS_MODULE, PYTHONUNBUFFERED="1"
        )
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self._log_file = log.open("wb")
        # A session of its own: Ctrl-C reaches only the driver, which then stops the
        # children in order (relay first, then the worker).
        self.process = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise DemoFailed(f"the {self.name} exited with code {code}:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"  {self.name} did not stop within {timeout:.0f} s; killing it")
                self.process.kill()
                self.process.wait()
        self._log_file.close()

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "    (no log)"
        return "\n".join(f"    | {line}" for line in text) or "    (empty log)"


def stop_all(children: list[Child]) -> None:
    """Relay first (nothing new reaches the broker), then the worker (warm shutdown)."""
    quiet = not any(child.running for child in children)
    started = time.monotonic()
    if not quiet:
        print("Stopping the relay and the worker ...", end=" ", flush=True)
    for child in children:
        child.stop()
    if not quiet:
        print(f"done ({time.monotonic() - started:.1f} s).")


def start_relay(var: Path) -> Child:
    argv = [sys.executable, "-m", "django", "outbox", "relay"]
    argv += ["--liveness-file", str(var / "relay.alive")]
    return Child("relay", argv, var / "relay.log")


def start_worker(var: Path, queue: str) -> Child:
    argv = [sys.executable, "-m", "celery", "-A", "demo.celery", "worker"]
    argv += ["--pool", "solo", "--loglevel", "warning", "--hostname", f"{queue}@%h"]
    argv += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    return Child("worker", argv, var / "worker.log")


def wait_until_ready(children: list[Child], files: list[Path], timeout: float) -> float:
    """Wait for the relay's liveness file and the worker's ready file."""
    started = time.monotonic()
    while not all(path.exists() for path in files):
        for child in children:
            child.check_alive()
        if time.monotonic() - started > timeout:
            missing = ", ".join(p.name for p in files if not p.exists())
            logs = "\n".join(f"  {c.name} log:\n{c.tail()}" for c in children)
            raise DemoFailed(
                f"not ready after {timeout:.0f} s (missing {missing}).\n{logs}"
            )
        time.sleep(0.05)
    return time.monotonic() - started


# -- the database --------------------------------------------------------------------


def prepare_var(var: Path) -> None:
    """Recreate the work directory, empty."""
    shutil.rmtree(var, ignore_errors=True)
    var.mkdir(parents=True)


def make_broker_folders(settings: Any) -> None:
    """The filesystem transport expects its folders to exist."""
    if not settings.CELERY_BROKER_URL.startswith("filesystem://"):
        return
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    for key in (
        "data_folder_in",
        "data_folder_out",
        "control_folder",
        "processed_folder",
    ):
        if options.get(key):
            Path(options[key]).mkdir(parents=True, exist_ok=True)


def enable_wal(path: Path) -> None:
    """Switch a new SQLite file to WAL once: readers and the writer stop blocking each other."""
    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("PRAGMA journal_mode=WAL")


def setup_django() -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE
    import django

    django.setup()
    import demo.celery  # noqa: F401  (creates the OutboxCelery app)


def migrate_and_reset() -> None:
    """Bring the schema up to date, then forget everything an earlier run left behind."""
    from django.core.management import call_command
    from django.db import Error as DatabaseError
    from django.db import transaction

    from celery_outbox.models import DeadLetter, OutboxMessage
    from demo.shop.models import Order, Receipt

    try:
        call_command("migrate", verbosity=0, interactive=False)
    except DatabaseError as exc:
        raise DemoFailed(
            f"cannot migrate the database: {type(exc).__name__}: {exc}"
        ) from exc
    with transaction.atomic():
        Receipt.objects.all().delete()
        Order.objects.all().delete()
        # Only the demo's own messages: the database may hold other projects' rows.
        OutboxMessage.objects.filter(task_name="demo.send_receipt").delete()
        DeadLetter.objects.filter(task_name="demo.send_receipt").delete()


def describe_backends(settings: Any) -> tuple[str, str]:
    database = settings.DATABASES["default"]
    engine = database["ENGINE"].rsplit(".", 1)[-1]
    if engine == "sqlite3":
        where = _relative(Path(database["NAME"]))
        db = f"SQLite ({where})"
    else:
        host = database.get("HOST") or "local socket"
        port = f":{database['PORT']}" if database.get("PORT") else ""
        db = f"{engine} {database['NAME']} on {host}{port}"
    url = settings.CELERY_BROKER_URL
    if url.startswith("filesystem://"):
        folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]).parent
        broker = f"kombu filesystem transport ({_relative(folder)})"
    else:
        broker = redact(url)
    return db, f"{broker}, queue {settings.DEMO_QUEUE}"


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# -- the business part ---------------------------------------------------------------


class RollBack(Exception):
    """Raised inside ``atomic()`` to abandon an order, as a failed payment would."""


def place_orders(count: int, rollback_every: int, outcome: Outcome) -> None:
    """Each order in its own transaction; every ``rollback_every``-th one fails."""
    from django.db import transaction
    from django.utils import timezone

    from demo.shop.models import Order
    from demo.shop.tasks import send_receipt

    for n in range(1, count + 1):
        fail = rollback_every > 0 and n % rollback_every == 0
        task_id = ""
        try:
            with transaction.atomic():
                order = Order.objects.create(
                    number=f"A-{n:04d}", total_cents=1000 + 37 * n
                )
                task_id = send_receipt.delay(order.id).id
                if fail:
                    raise RollBack(order.number)
        except RollBack:
            outcome.rolled_back.add(task_id)
        else:
            outcome.committed[task_id] = timezone.now()


def collect_runs(outcome: Outcome) -> None:
    from demo.shop.models import Receipt

    ours = outcome.committed.keys() | outcome.rolled_back
    runs: dict[str, list[datetime]] = {}
    foreign = 0
    for task_id, executed_at in Receipt.objects.order_by("id").values_list(
        "task_id", "executed_at"
    ):
        if task_id in ours:
            runs.setdefault(task_id, []).append(executed_at)
        else:
            foreign += 1
    outcome.runs, outcome.foreign = runs, foreign


def wait_for_receipts(outcome: Outcome, children: list[Child], timeout: float) -> float:
    """Until every committed order's receipt ran (or ``timeout``); returns the time taken."""
    started = time.monotonic()
    while True:
        collect_runs(outcome)
        if outcome.executed == len(outcome.committed):
            return time.monotonic() - started
        for child in children:
            child.check_alive()
        if time.monotonic() - started > timeout:
            return time.monotonic() - started
        time.sleep(0.05)


def outbox_stats() -> dict[str, Any]:
    from django.core.management import call_command

    out = io.StringIO()
    call_command("outbox", "stats", "--format", "json", stdout=out)
    return dict(json.loads(out.getvalue()))


# -- output ----------------------------------------------------------------------------


def report(outcome: Outcome, out: TextIO = sys.stdout) -> None:
    committed, rolled_back = len(outcome.committed), len(outcome.rolled_back)
    latencies = outcome.latencies_ms
    rows = [
        ("orders committed", str(committed), ""),
        ("orders rolled back", str(rolled_back), ""),
        (
            "receipts executed (of committed)",
            f"{outcome.executed} / {committed}",
            "all",
        ),
        (
            "receipts never executed (of rolled back)",
            f"{outcome.never_executed} / {rolled_back}",
            "all",
        ),
        ("duplicate executions", str(outcome.duplicates), "0"),
    ]
    if latencies:
        rows.append(
            ("commit -> execution, p50", f"{statistics.median(latencies):.0f} ms", "")
        )
        rows.append(("commit -> execution, max", f"{max(latencies):.0f} ms", ""))
    pending = outcome.outbox_left.get("pending")
    if pending is not None:
        rows.append(("outbox rows still pending", str(pending), "0"))
    width = max(len(label) for label, _, _ in rows)
    values = max(len(value) for _, value, _ in rows)
    print(f"\n  {'':<{width}}  {'result':>{values}}  expected", file=out)
    for label, value, expected in rows:
        print(f"  {label:<{width}}  {value:>{values}}  {expected}".rstrip(), file=out)
    if outcome.foreign:
        print(
            f"\n  ({outcome.foreign} receipt(s) from tasks of another run ignored)",
            file=out,
        )


def verdict(outcome: Outcome) -> str:
    if outcome.held:
        return (
            "Guarantee held: every committed order got exactly one receipt, and no "
            "rolled-back order got one."
        )
    problems = []
    missing = len(outcome.committed) - outcome.executed
    if missing:
        problems.append(f"{missing} committed order(s) never got their receipt")
    leaked = len(outcome.rolled_back) - outcome.never_executed
    if leaked:
        problems.append(f"{leaked} rolled-back order(s) got a receipt anyway")
    if outcome.duplicates:
        problems.append(f"{outcome.duplicates} receipt(s) ran more than once")
    return "GUARANTEE BROKEN: " + "; ".join(problems) + "."


# -- main ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--orders", type=int, default=20, help="orders to place (20)")
    parser.add_argument(
        "--rollback-every",
        type=int,
        default=4,
        help="roll back every Nth order (4; 0: none)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the receipts (60)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=2.0,
        help="seconds to keep watching for receipts that must never come (2)",
    )
    args = parser.parse_args(argv)
    if (
        args.orders < 1
        or args.rollback_every < 0
        or args.timeout <= 0
        or args.grace < 0
    ):
        parser.error(
            "--orders must be >= 1, --rollback-every >= 0, --timeout > 0, --grace >= 0"
        )
    return args


def _ordinal(n: int) -> str:
    suffix = (
        "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    )
    return f"{n}{suffix}"


def _raise_abort(signum: int, _frame: FrameType | None) -> None:
    raise Abort(signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    var = var_dir()
    # A queue of its own for this run, inherited by the relay and the worker.
    queue = f"celery-outbox-demo-{uuid.uuid4().hex[:8]}"
    os.environ["DEMO_QUEUE"] = queue
    prepare_var(var)
    if not os.environ.get("DATABASE_URL"):
        enable_wal(var / "demo.sqlite3")
    setup_django()
    from django.conf import settings

    from demo.celery import READY_FILE

    make_broker_folders(settings)
    database, broker = describe_backends(settings)
    print("celery-outbox demo")
    print(f"  database  {database}")
    print(f"  broker    {broker}")
    print(f"  logs      {_relative(var)}/relay.log, {_relative(var)}/worker.log")

    previous_term = signal.signal(signal.SIGTERM, _raise_abort)
    previous_int = signal.getsignal(signal.SIGINT)
    children: list[Child] = []
    try:
        migrate_and_reset()
        children.append(start_relay(var))
        children.append(start_worker(var, queue))
        took = wait_until_ready(children, [var / "relay.alive", var / READY_FILE], 30.0)
        print(f"\nRelay and worker are up ({took:.1f} s).")

        outcome = Outcome()
        plan = f"Placing {args.orders} orders, each in its own transaction"
        if args.rollback_every:
            every = args.rollback_every
            plan += (
                "; rolling back every one"
                if every == 1
                else f"; rolling back every {_ordinal(every)} one"
            )
        print(f"{plan} ...")
        place_orders(args.orders, args.rollback_every, outcome)
        took = wait_for_receipts(outcome, children, args.timeout)
        if outcome.executed == len(outcome.committed):
            print(
                f"All {len(outcome.committed)} committed receipts ran ({took:.1f} s)."
            )
        else:
            print(f"Gave up waiting for receipts after {took:.0f} s.")
        print(f"Watching {args.grace:g} s more for receipts that must never run ...")
        time.sleep(args.grace)
        collect_runs(outcome)
        outcome.outbox_left = outbox_stats()
        stop_all(children)
        report(outcome)
        print()
        print(verdict(outcome))
        if not outcome.held:
            logs = "\n".join(f"  {c.name} log:\n{c.tail()}" for c in children)
            print(f"\n{logs}", file=sys.stderr)
            return 1
        print(
            "\nThe code: the orders and their send_receipt.delay() in "
            "demo/run.py (place_orders), the task in demo/shop/tasks.py, the app in "
            "demo/celery.py, the settings in demo/settings.py.\nFor your own project: "
            "README.md, 'Quick start'; docs/quickstart.md walks through it."
        )
        return 0
    except DemoFailed as exc:
        print(f"\nDemo failed: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Abort):
        print("\nInterrupted.", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(children)
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)
