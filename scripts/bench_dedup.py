"""Time ``dedup_key`` enqueues on MariaDB: what the dedup lock costs per call.

Three variants take turns in rounds, each enqueue in its own ``transaction.atomic()``
on the test project's MariaDB alias (a database of its own, ``outbox_dedup_bench``,
dropped at the end):

* ``plain``: no ``dedup_key`` (the baseline);
* ``new``: a key no row holds (the path a lock guards);
* ``held``: a key whose row is committed and still in its window (refused).

Prints the median over the rounds of the milliseconds per enqueue.
Run: ``PYTHONPATH=. .venv/bin/python scripts/bench_dedup.py [--rounds 10] [--per-round 100]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

os.environ["OUTBOX_TEST_DB"] = "mysql"
os.environ["OUTBOX_MYSQL_NAME"] = "outbox_dedup_bench"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.project.settings")

import django
import pymysql

NAME = os.environ["OUTBOX_MYSQL_NAME"]


def server_sql(statement: str) -> None:
    """Run one statement on the MariaDB server, outside any database."""
    conn = pymysql.connect(host="127.0.0.1", user="root", password="")
    try:
        with conn.cursor() as cursor:
            cursor.execute(statement)
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=100)
    args = parser.parse_args()
    server_sql(f"DROP DATABASE IF EXISTS {NAME}")
    server_sql(f"CREATE DATABASE {NAME}")
    try:
        django.setup()
        run(args.rounds, args.per_round)
    finally:
        server_sql(f"DROP DATABASE IF EXISTS {NAME}")


def run(rounds: int, per_round: int) -> None:
    from django.core.management import call_command
    from django.db import transaction
    from django.test.utils import override_settings

    from tests.project.shop.tasks import record

    call_command("migrate", database="default", verbosity=0)
    with transaction.atomic():
        record.apply_async(("held",), dedup_key="held", dedup_window=86400)

    def enqueue(key: Callable[[], str | None]) -> None:
        with transaction.atomic():
            record.apply_async(("x",), dedup_key=key(), ignore_result=True)

    variants: dict[str, Callable[[], None]] = {
        "plain": lambda: enqueue(lambda: None),
        "new": lambda: enqueue(lambda: uuid.uuid4().hex),
        "held": lambda: enqueue(lambda: "held"),
    }
    figures: dict[str, list[float]] = {name: [] for name in variants}
    with override_settings(CELERY_OUTBOX_PUBLISH_ON_COMMIT=False):
        for _ in range(rounds):
            for name, call in variants.items():
                started = time.perf_counter()
                for _ in range(per_round):
                    call()
                elapsed = time.perf_counter() - started
                figures[name].append(1000 * elapsed / per_round)
    for name, values in figures.items():
        print(
            f"{name:6} median {statistics.median(values):.2f} ms per enqueue "
            f"(rounds: {min(values):.2f} to {max(values):.2f})"
        )


if __name__ == "__main__":
    main()
