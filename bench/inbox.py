"""The inbox part of the benchmark: what ``inbox=True`` adds to one task's execution.

The same task body (one INSERT of a ``BenchOrder``) runs through Celery's
``Task.apply`` (eager: no broker, no worker) as four tasks:

* ``autocommit``: ``inbox=False``, the INSERT in autocommit;
* ``atomic``: ``inbox=False``, the INSERT in the body's own ``transaction.atomic()``;
* ``atomic+row``: ``atomic``, plus the inbox's INSERT written by hand in the body: what
  the extra statement costs on its own;
* ``inbox``: ``inbox=True``, the INSERT in the inbox's transaction, after the inbox row.

They take turns in short rounds, so a slow spell of the machine falls on all four;
each figure is the median over the rounds of the time per task, and a difference is
the median over the rounds of that round's difference. The statements Django sends
for one run of each task are counted with ``CaptureQueriesContext`` (Django logs
``BEGIN`` and ``COMMIT`` too).

Each database runs in a child process (``python -m bench.inbox --vendor ...``)
whose settings (``bench.inbox_settings``) add the inbox app.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import env
from bench.harness import BenchError, child_env, child_json, median, verdict

VARIANTS = ("autocommit", "atomic", "atomic+row", "inbox")
VENDORS = {"postgresql": "PostgreSQL", "mysql": "MariaDB"}
#: What the inbox may add to the statements of the task's transaction.
TARGET_EXTRA_STATEMENTS = 1
#: The rows this run writes are tagged with it, and only they are deleted at the end:
#: the bench database may be shared.
TAG = f"inbox-{env.RUN_ID}-"
#: The names of this run's tasks start with it: their inbox rows are this run's.
TASK_PREFIX = f"bench.inbox.{env.RUN_ID}."
CHILD_TIMEOUT = 900.0


@dataclass(frozen=True)
class InboxSizes:
    """Rounds (every variant once per round) and task runs per variant and round."""

    rounds: int
    per_round: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> InboxSizes:
        sizes = cls(4, 50) if quick else cls(10, 150)
        if repeats is None:
            return sizes
        return dataclasses.replace(sizes, rounds=max(1, repeats))


@dataclass(frozen=True)
class VendorResult:
    """What one child measured on one database."""

    vendor: str
    server: str
    #: Microseconds per task, one sample per round, by variant.
    samples: dict[str, list[float]]
    #: The statements Django sent for one run, by variant.
    statements: dict[str, list[str]]

    def per_task(self, variant: str) -> float:
        return median(self.samples[variant])

    def paired(self, variant: str, baseline: str) -> float:
        """Median over the rounds of the difference per task (µs)."""
        return median(
            [
                a - b
                for a, b in zip(
                    self.samples[variant], self.samples[baseline], strict=True
                )
            ]
        )

    def extra_statements(self) -> list[str]:
        """What the inbox run sent beyond the ``atomic`` run."""
        extra = list(self.statements["inbox"])
        for sql in self.statements["atomic"]:
            if sql in extra:
                extra.remove(sql)
        return extra


# -- the child: one database ----------------------------------------------------


def make_tasks() -> dict[str, Any]:
    """The four tasks, on the bench's ``OutboxCelery`` app (whose class is OutboxTask)."""
    from django.db import transaction

    from bench.celery import app
    from bench.models import BenchOrder
    from celery_outbox.inbox.store import InboxStore

    store = InboxStore("default")

    def write(number: int) -> None:
        BenchOrder.objects.create(number=f"{TAG}{number}", amount=number)

    def own_atomic(number: int) -> None:
        with transaction.atomic():
            write(number)

    def own_atomic_and_row(number: int) -> None:
        with transaction.atomic():
            store.record(f"{TASK_PREFIX}by_hand", f"{TAG}{number}")
            write(number)

    def task(name: str, inbox: bool, body: Callable[[int], None]) -> Any:
        register: Callable[..., Any] = app.task
        return register(
            name=f"{TASK_PREFIX}{name}", inbox=inbox, shared=False, lazy=False
        )(body)

    return {
        "autocommit": task("autocommit", False, write),
        "atomic": task("atomic", False, own_atomic),
        "atomic+row": task("atomic_and_row", False, own_atomic_and_row),
        "inbox": task("inbox", True, write),
    }


def statement(sql: str) -> str:
    """``INSERT INTO "table"``: the verb and the table, without the values."""
    return " ".join(sql.split()[:3])


def count_statements(task: Any, number: int) -> list[str]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        task.apply((number,), throw=True)
    return [statement(query["sql"]) for query in captured.captured_queries]


def run_rounds(
    tasks: dict[str, Any], sizes: InboxSizes, clock: Callable[[], int]
) -> tuple[dict[str, list[float]], int]:
    """Time every variant once per round, in a rotating order; round 0 warms up.

    Returns the samples (µs per task) and the number of runs of each variant.
    """
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    number = 0
    for round_ in range(sizes.rounds + 1):
        shift = round_ % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            task = tasks[name]
            started = clock()
            for _ in range(sizes.per_round):
                number += 1
                task.apply((number,), throw=True)
            elapsed = clock() - started
            if round_:
                samples[name].append(elapsed / sizes.per_round / 1000)
    return samples, (sizes.rounds + 1) * sizes.per_round


def server_version(vendor: str) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SHOW server_version" if vendor == "postgresql" else "SELECT VERSION()"
        )
        return str(cursor.fetchone()[0])


def ensure_database(vendor: str) -> None:
    if vendor == "postgresql":
        env.ensure_database()
        return
    import pymysql
    from django.conf import settings

    config = settings.DATABASES["default"]
    conn = pymysql.connect(
        host=config["HOST"],
        port=int(config["PORT"]),
        user=config["USER"],
        password=config["PASSWORD"],
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                f"CREATE DATABASE IF NOT EXISTS `{config['NAME']}` CHARACTER SET utf8mb4"
            )
    finally:
        conn.close()


def forget_rows() -> None:
    """Delete this run's orders and inbox rows (and nothing else)."""
    from bench.models import BenchOrder
    from celery_outbox.inbox.models import InboxEntry

    BenchOrder.objects.filter(number__startswith=TAG).delete()
    InboxEntry.objects.filter(task_name__startswith=TASK_PREFIX).delete()


def measure(vendor: str, sizes: InboxSizes) -> VendorResult:
    """Run the four tasks on this process's database; check every run wrote its rows."""
    from django.core.management import call_command

    env.setup_django()
    ensure_database(vendor)
    call_command("migrate", verbosity=0)
    from bench.models import BenchOrder
    from celery_outbox.inbox.models import InboxEntry

    forget_rows()
    tasks = make_tasks()
    try:
        samples, runs = run_rounds(tasks, sizes, time.perf_counter_ns)
        statements = {
            name: count_statements(tasks[name], -1 - i)
            for i, name in enumerate(VARIANTS)
        }
        orders = BenchOrder.objects.filter(number__startswith=TAG).count()
        entries = InboxEntry.objects.filter(task_name__startswith=TASK_PREFIX)
        expected = (len(VARIANTS) * (runs + 1), 2 * (runs + 1))
        if (orders, entries.count()) != expected:
            raise BenchError(
                f"{vendor}: {orders} orders and {entries.count()} inbox rows written, "
                f"expected {expected[0]} and {expected[1]}"
            )
        return VendorResult(vendor, server_version(vendor), samples, statements)
    finally:
        forget_rows()


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inbox")
    parser.add_argument("--vendor", choices=sorted(VENDORS), required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--per-round", type=int, required=True)
    args = parser.parse_args(argv)
    result = measure(args.vendor, InboxSizes(args.rounds, args.per_round))
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


# -- the driver: one child per database, one table ----------------------------


def run_child(vendor: str, sizes: InboxSizes) -> VendorResult:
    args = ["--vendor", vendor, "--rounds", str(sizes.rounds)]
    args += ["--per-round", str(sizes.per_round)]
    environ = child_env(
        DJANGO_SETTINGS_MODULE="bench.inbox_settings",
        OUTBOX_BENCH_INBOX_VENDOR=vendor,
    )
    found = child_json(
        "bench.inbox", args, environ, CHILD_TIMEOUT, f"the inbox part on {vendor}"
    )
    return VendorResult(**found)


def render(results: list[VendorResult], sizes: InboxSizes) -> str:
    out = [
        f"6. inbox: one task run by Task.apply (eager, no broker), µs per task, median "
        f"of {sizes.rounds} rounds of {sizes.per_round} runs taking turns",
        f"  {'':<12}" + "".join(f" {v:>11}" for v in VARIANTS) + "   statements",
    ]
    for result in results:
        counts = " / ".join(str(len(result.statements[v])) for v in VARIANTS)
        out.append(
            f"  {VENDORS[result.vendor]:<12}"
            + "".join(f" {result.per_task(v):>11.0f}" for v in VARIANTS)
            + f"   {counts}"
        )
    for result in results:
        extra = result.extra_statements()
        ok = len(extra) <= TARGET_EXTRA_STATEMENTS
        out.append(
            f"  {VENDORS[result.vendor]} ({result.server}): inbox - atomic "
            f"{result.paired('inbox', 'atomic'):+.0f} µs per task, of which the "
            f"INSERT alone (atomic+row - atomic) {result.paired('atomic+row', 'atomic'):+.0f}"
            f" µs; inbox - autocommit {result.paired('inbox', 'autocommit'):+.0f} µs; "
            f"extra statements {len(extra)} ({', '.join(extra) or 'none'}), "
            f"target <= {TARGET_EXTRA_STATEMENTS}: {verdict(ok)}"
        )
    return "\n".join(out)


def bench_inbox(
    quick: bool, repeats: int | None = None, vendors: tuple[str, ...] = tuple(VENDORS)
) -> str:
    """Measure the inbox's cost per task on each database; the rendered table."""
    sizes = InboxSizes.pick(quick, repeats)
    return render([run_child(vendor, sizes) for vendor in vendors], sizes)


if __name__ == "__main__":
    sys.exit(child_main())
