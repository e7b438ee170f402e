"""``python -m bench --only history``: the drain with the history off and on.

One relay drains the same filled table to RabbitMQ (publisher confirms on), once
with ``CELERY_OUTBOX_HISTORY`` off and once on, in alternating rounds so that a slow
spell of the machine falls on both alike. The history table is emptied before each
round: every round starts from the same tables. The figure is the ratio of the
medians (target: the drain with history keeps at least 70 % of its rate), with the
median of the rounds' own ratios beside it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from bench.harness import (
    BenchError,
    Brokers,
    Child,
    Sizes,
    child_env,
    fill,
    outbox_count,
    verdict,
)

#: The drain with history must keep at least this share of the drain without.
TARGET_RATIO = 0.70
#: The relay's settings module, by whether it writes history.
SETTINGS = {False: "bench.settings", True: "bench.history_settings"}


def history_count() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM celery_outbox_history")
        return int(cursor.fetchone()[0])


def clear_history() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE celery_outbox_history")


def drain_rate(history: bool, envelopes: Sequence[Any], brokers: Brokers) -> float:
    """Tasks per second for one relay to empty the filled table to RabbitMQ."""
    expected = len(envelopes)
    brokers.purge("amqp")
    fill(envelopes)
    clear_history()
    environ = child_env(OUTBOX_BENCH_BROKER="amqp")
    environ["DJANGO_SETTINGS_MODULE"] = SETTINGS[history]
    child = Child(["-m", "bench.proc", "relay"], environ)
    try:
        child.expect("ready", timeout=60)
        child.send("go")
        done = json.loads(child.expect("done ", timeout=300)[5:])
        if child.proc.wait(timeout=30) != 0:
            raise BenchError(f"relay exited with {child.proc.returncode}")
    finally:
        child.stop()
    left = outbox_count()
    if left:
        raise BenchError(f"history={history}: {left} rows left in the outbox")
    count = brokers.wait_count("amqp", expected)
    if count != expected:
        raise BenchError(
            f"history={history}: the queue holds {count} messages, expected {expected}"
        )
    events = history_count()
    if events != (expected if history else 0):
        raise BenchError(f"history={history}: {events} history events for {expected}")
    brokers.purge("amqp")
    return expected / (float(done["end"]) - float(done["start"]))


def bench_history(sizes: Sizes, brokers: Brokers, envelopes: Sequence[Any]) -> str:
    """Alternating rounds of the drain without and with history; the table to print."""
    rows = envelopes[: sizes.drain_rows]
    rounds = max(2, 2 * sizes.drain_repeats)
    samples: dict[bool, list[float]] = {False: [], True: []}
    for number in range(rounds):
        # Which variant goes first alternates too: neither always follows a fill.
        for history in (False, True) if number % 2 == 0 else (True, False):
            samples[history].append(drain_rate(history, rows, brokers))
    clear_history()
    off = statistics.median(samples[False])
    on = statistics.median(samples[True])
    pairs = zip(samples[True], samples[False], strict=True)
    paired = statistics.median([a / b for a, b in pairs])
    return "\n".join(
        [
            f"8. history: one relay, {len(rows):,} rows -> RabbitMQ, confirms on, "
            f"tasks/s, median of {rounds} rounds taking turns",
            f"  history off {off:>10,.0f} /s   samples "
            + ", ".join(f"{s:,.0f}" for s in samples[False]),
            f"  history on  {on:>10,.0f} /s   samples "
            + ", ".join(f"{s:,.0f}" for s in samples[True]),
            f"  on / off    {on / off:>10.0%}      (median of the rounds' ratios "
            f"{paired:.0%})   target >= {TARGET_RATIO:.0%}: "
            f"{verdict(on / off >= TARGET_RATIO)}",
        ]
    )
