"""``python -m bench --only settle``: the cost of settling a batch the broker refused.

A relay settles each batch in one transaction. When the broker refuses every message
(an exchange deleted, say), each row gets its own retry delay and reason, or goes
to the dead letters with its reason; with ``CELERY_OUTBOX_HISTORY`` on, each also
gets a history event. This part fills the outbox with N rows, claims them all, and
times the relay store's ``settle`` of N refusals (retry) and of N dead letters, history
on, for N = 1,000 to 64,000, on PostgreSQL, MariaDB and SQLite (each in a child
process with a database of its own, ``bench.settle_settings``). The cost must grow
linearly: the figure that matters is the time per row at 64,000 against 1,000.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.harness import BenchError, child_env, child_json, verdict

VENDORS = {"postgresql": "PostgreSQL", "mysql": "MariaDB", "sqlite": "SQLite"}
KINDS = ("retry", "dead letter")
#: The time per row at the largest size may be at most this many times the smallest's.
TARGET_GROWTH = 2.0
REASON = "NOT_FOUND - no exchange 'billing' in vhost '/'"
CHILD_TIMEOUT = 1800.0


@dataclass(frozen=True)
class SettleResult:
    """Seconds per settlement (median of the repeats), by kind and rows."""

    vendor: str
    seconds: dict[str, dict[str, float]]

    def per_row_us(self, kind: str, rows: int) -> float:
        return self.seconds[kind][str(rows)] / rows * 1e6


def ensure_database(vendor: str) -> None:
    """Create the part's own database (PostgreSQL, MariaDB) when it is missing."""
    from django.conf import settings

    from bench import env, inbox

    if vendor == "postgresql":
        env.ensure_database(settings.DATABASES["default"]["NAME"])
    elif vendor == "mysql":
        inbox.ensure_database(vendor)  # the settings' database, as the inbox part's


def empty_tables() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        for table in (
            "celery_outbox_message",
            "celery_outbox_deadletter",
            "celery_outbox_history",
        ):
            cursor.execute(f"DELETE FROM {table}")


def template(number: int) -> Any:
    """A small message as the enqueue path stores it (only its row matters here)."""
    from celery_outbox.envelope import Envelope

    task_id = f"settle-{number:08d}"
    return Envelope(
        task_id=task_id,
        task_name="bench.noop",
        exchange="billing",
        routing_key="billing",
        body=b"[[1], {}, {}]",
        content_type="application/json",
        content_encoding="utf-8",
        headers={"id": task_id, "task": "bench.noop"},
        properties={"correlation_id": task_id, "delivery_mode": 2},
        declare=(),
        queue="billing",
    )


def settle_once(rows: int, kind: str) -> float:
    """Fill ``rows`` rows, claim them all, and time the settlement of ``kind``."""
    from django.db import transaction

    from celery_outbox.outcomes import Action, Decision, Settlement
    from celery_outbox.store import Stores

    empty_tables()
    stores = Stores("default", history=True)
    store = stores.relay()
    envelopes = [template(n) for n in range(rows)]
    with transaction.atomic():
        for start in range(0, rows, 1000):
            stores.writer().insert(envelopes[start : start + 1000])
    claim = store.claim(rows, 600)
    if len(claim.messages) != rows:
        raise BenchError(f"claimed {len(claim.messages)} of {rows} rows")
    jitter = random.Random(rows)
    if kind == "retry":
        decisions = tuple(
            Decision(m.id, Action.RETRY, 30 + jitter.random() * 30, REASON)
            for m in claim.messages
        )
        settlement = Settlement(retry=decisions)
    else:
        decisions = tuple(
            Decision(m.id, Action.DEAD_LETTER, 0.0, REASON) for m in claim.messages
        )
        settlement = Settlement(dead_letter=decisions)
    started = time.perf_counter()
    report = store.settle(claim.token, settlement)
    elapsed = time.perf_counter() - started
    done = report.retried if kind == "retry" else report.dead_lettered
    if done != rows:
        raise BenchError(f"settled {done} of {rows} rows ({kind})")
    return elapsed


def measure(vendor: str, sizes: list[int], repeats: int) -> SettleResult:
    from django.core.management import call_command

    from bench import env

    env.setup_django()
    ensure_database(vendor)
    call_command("migrate", "celery_outbox", verbosity=0)
    seconds: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    try:
        for rows in sizes:
            for kind in KINDS:
                samples = [settle_once(rows, kind) for _ in range(repeats)]
                seconds[kind][str(rows)] = statistics.median(samples)
    finally:
        empty_tables()
    return SettleResult(vendor, seconds)


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.settle")
    parser.add_argument("--vendor", choices=sorted(VENDORS), required=True)
    parser.add_argument("--sizes", required=True, help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    result = measure(args.vendor, sizes, args.repeats)
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


def run_child(vendor: str, sizes: list[int], repeats: int) -> SettleResult:
    args = ["--vendor", vendor, "--sizes", ",".join(map(str, sizes))]
    environ = child_env(
        DJANGO_SETTINGS_MODULE="bench.settle_settings",
        OUTBOX_BENCH_SETTLE_VENDOR=vendor,
    )
    found = child_json(
        "bench.settle",
        [*args, "--repeats", str(repeats)],
        environ,
        CHILD_TIMEOUT,
        f"the settle part on {vendor}",
    )
    return SettleResult(**found)


def render(results: list[SettleResult], sizes: list[int], repeats: int) -> str:
    out = [
        f"14. settling N refused rows in one batch (history on): ms per batch, median "
        f"of {repeats}; µs per row at the largest N against the smallest",
        f"  {'':<24}" + "".join(f" {size:>9,}" for size in sizes) + "   growth",
    ]
    for result in results:
        for kind in KINDS:
            row = result.seconds[kind]
            growth = result.per_row_us(kind, sizes[-1]) / result.per_row_us(
                kind, sizes[0]
            )
            out.append(
                f"  {VENDORS[result.vendor] + ' ' + kind:<24}"
                + "".join(f" {row[str(size)] * 1000:>9.0f}" for size in sizes)
                + f"   x{growth:.1f} (target <= x{TARGET_GROWTH:.0f}: "
                f"{verdict(growth <= TARGET_GROWTH)})"
            )
    return "\n".join(out)


def bench_settle(quick: bool, repeats: int | None = None) -> str:
    """Time the settlement of N refused rows on each database; the rendered table."""
    sizes = [1_000, 4_000] if quick else [1_000, 4_000, 16_000, 64_000]
    count = repeats or (1 if quick else 3)
    results = [run_child(vendor, sizes, count) for vendor in VENDORS]
    return render(results, sizes, count)


if __name__ == "__main__":
    sys.exit(child_main())
