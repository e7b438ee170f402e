"""The demo driver: a real relay, real workers, every lane's work placed and checked.

Steps: recreate ``demo/var``; migrate; start ``manage.py outbox relay`` and a Celery
worker as subprocesses (and, on RabbitMQ or Redis, one worker per service that
receives events); place each lane's work (``demo/lanes/``), each unit in its own
transaction, rolling some back; wait until everything committed has run, then a
little longer; print one table of what ran and exit 0 only if every promise held.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import sqlite3
import sys
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from demo.config import ready_file, redact, var_dir
from demo.lanes import Events, HandlerOutbox, Inbox, Lane, Row, StrictOrder, Tasks
from demo.processes import (
    SETTINGS_MODULE,
    Child,
    DemoFailed,
    start_relay,
    start_worker,
    stop_all,
    wait_until_ready,
)

#: The services that receive the demo's events, each with its app module.
SERVICES = {"billing": "demo.billing", "shipping": "demo.shipping"}
#: What to run to see events, when the broker cannot route them.
EVENTS_ELSEWHERE = "CELERY_BROKER_URL=redis://127.0.0.1:6379/0 .venv/bin/python -m demo"


class Abort(BaseException):
    """SIGTERM to the driver: unwind through ``finally`` like Ctrl-C does."""


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
    import contextlib

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

    from celery_outbox.handlers.models import HandlerMessage
    from celery_outbox.models import DeadLetter, OutboxMessage
    from demo.shop.models import Order, Receipt, Run
    from demo.shop.receivers import PARCEL_NOTE

    try:
        call_command("migrate", verbosity=0, interactive=False)
    except DatabaseError as exc:
        raise DemoFailed(
            f"cannot migrate the database: {type(exc).__name__}: {exc}"
        ) from exc
    with transaction.atomic():
        Receipt.objects.all().delete()
        Run.objects.all().delete()
        Order.objects.all().delete()
        # Only the demo's own messages: the database may hold other projects' rows.
        OutboxMessage.objects.filter(task_name__startswith="demo.").delete()
        DeadLetter.objects.filter(task_name__startswith="demo.").delete()
        HandlerMessage.objects.filter(category=PARCEL_NOTE).delete()


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


def events_unavailable(settings: Any) -> str:
    """How to see events when this broker cannot route them ("" when it can)."""
    scheme = settings.CELERY_BROKER_URL.split("://", 1)[0].split("+", 1)[-1]
    if scheme in {"amqp", "amqps", "pyamqp", "redis", "rediss"}:
        return ""
    return (
        "Events need RabbitMQ or Redis (a topic exchange the relay and the services' "
        f"workers share). To see them: {EVENTS_ELSEWHERE} (the venv of `make check`, "
        "which has redis-py), or amqp://guest:guest@127.0.0.1:5672// for RabbitMQ."
    )


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# -- running ---------------------------------------------------------------------------


def wait_for(lanes: list[Lane], children: list[Child], timeout: float) -> float:
    """Until every lane's committed work ran (or ``timeout``); returns the time taken."""
    started = time.monotonic()
    while True:
        for lane in lanes:
            lane.collect()
        if all(lane.complete() for lane in lanes):
            return time.monotonic() - started
        for child in children:
            child.check_alive()
        if time.monotonic() - started > timeout:
            return time.monotonic() - started
        time.sleep(0.05)


def outbox_stats() -> dict[str, Any]:
    from django.core.management import call_command

    out = io.StringIO()
    call_command("outbox", "tasks", "stats", "--format", "json", stdout=out)
    return dict(json.loads(out.getvalue()))


def handler_messages_waiting() -> int:
    from celery_outbox.handlers.models import HandlerMessage
    from demo.shop.receivers import PARCEL_NOTE

    return HandlerMessage.objects.filter(category=PARCEL_NOTE).count()


# -- output ----------------------------------------------------------------------------


def report(lanes: list[Lane], left: list[Row], out: TextIO = sys.stdout) -> None:
    """One table: each lane's title, then its rows (what was sent, what ran)."""
    rows = [row for lane in lanes for row in lane.rows()] + left
    width = max(len(row.label) for row in rows) + 2
    values = max(len(row.result) for row in rows)
    print(f"\n  {'':<{width}}  {'result':>{values}}  expected", file=out)
    for lane in [*lanes, None]:
        print(f"  {lane.title if lane else 'left over'}", file=out)
        for row in lane.rows() if lane else left:
            line = (
                f"    {row.label:<{width - 2}}  {row.result:>{values}}  {row.expected}"
            )
            print(line.rstrip(), file=out)


def verdict(lanes: list[Lane]) -> tuple[bool, str]:
    problems = [problem for lane in lanes for problem in lane.problems()]
    if not problems:
        return True, (
            "Every promise held: each committed unit of work ran once (in order where "
            "asked), and nothing of a rolled-back transaction ran."
        )
    return False, "BROKEN: " + "; ".join(problems) + "."


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
        help="seconds to wait for everything committed to run (60)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=2.0,
        help="seconds to keep watching for runs that must never come (2)",
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


def _raise_abort(signum: int, _frame: FrameType | None) -> None:
    raise Abort(signum)


def start_processes(var: Path, queue: str, with_events: bool) -> list[Child]:
    """The relay, the tasks' worker and (with events) one worker per service, ready."""
    children = [start_relay(var), start_worker(var, "demo.celery", queue)]
    ready = [var / "relay.alive", ready_file("demo")]
    if with_events:
        for service, module in SERVICES.items():
            children.append(start_worker(var, module, queue, name=service))
            ready.append(ready_file(f"demo-{service}"))
    took = wait_until_ready(children, ready, 30.0)
    names = ", ".join(child.name for child in children)
    print(f"\nProcesses up: {names} ({took:.1f} s).")
    return children


def run(args: argparse.Namespace, var: Path, queue: str, settings: Any) -> int:
    unavailable = events_unavailable(settings)
    lanes: list[Lane] = [
        Tasks(orders=args.orders, rollback_every=args.rollback_every),
        StrictOrder(),
        HandlerOutbox(),
        Inbox(),
        Events(unavailable=unavailable),
    ]
    children: list[Child] = []
    try:
        migrate_and_reset()
        children = start_processes(var, queue, with_events=not unavailable)
        print(
            "Placing each lane's work, one transaction per unit, some rolled back ..."
        )
        for lane in lanes:
            lane.place()
        took = wait_for(lanes, children, args.timeout)
        if all(lane.complete() for lane in lanes):
            print(f"Everything committed has run ({took:.1f} s).")
        else:
            print(f"Gave up waiting after {took:.0f} s.")
        print(f"Watching {args.grace:g} s more for runs that must never come ...")
        time.sleep(args.grace)
        for lane in lanes:
            lane.collect()
        pending = outbox_stats().get("pending")
        waiting = handler_messages_waiting()
        stop_all(children)
        left = [
            Row("outbox rows still pending", str(pending), "0"),
            Row("handler outbox messages still waiting", str(waiting), "0"),
        ]
        report(lanes, left)
        held, text = verdict(lanes)
        held = held and pending == 0 and waiting == 0
        if unavailable:
            print(f"\n{unavailable}")
        print(f"\n{text}")
        if not held:
            logs = "\n".join(f"  {c.name} log:\n{c.tail()}" for c in children)
            print(f"\n{logs}", file=sys.stderr)
            return 1
        print(
            "\nThe code: each lane's transactions in demo/lanes/ (place), the tasks in "
            "demo/shop/tasks.py, the receiver in demo/shop/receivers.py, the event in "
            "demo/shop/events.py and its services in demo/services.py.\nWhich lane "
            "for which job: docs/choosing.md. Your own project: docs/quickstart.md."
        )
        return 0
    finally:
        # Ctrl-C once more must not leave a process behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(children)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    var = var_dir()
    # A queue of its own for this run, inherited by the relay and the workers.
    queue = f"celery-outbox-demo-{uuid.uuid4().hex[:8]}"
    os.environ["DEMO_QUEUE"] = queue
    prepare_var(var)
    if not os.environ.get("DATABASE_URL"):
        enable_wal(var / "demo.sqlite3")
    setup_django()
    from django.conf import settings

    make_broker_folders(settings)
    database, broker = describe_backends(settings)
    print("celery-outbox demo")
    print(f"  database  {database}")
    print(f"  broker    {broker}")
    print(f"  logs      {_relative(var)}/*.log")

    previous_term = signal.signal(signal.SIGTERM, _raise_abort)
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        return run(args, var, queue, settings)
    except DemoFailed as exc:
        print(f"\nDemo failed: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Abort):
        print("\nInterrupted.", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)
