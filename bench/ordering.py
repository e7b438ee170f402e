"""The database side of draining ordered keys: how fast claims and settlements go.

``python -m bench.ordering [--rows N] [--repeats N] [--batch N]`` fills the bench's
PostgreSQL outbox with the same messages laid out three ways (unkeyed; one key per
message; one hot key holding every other row, the rest one key each), drains each
with claim-then-delete through :class:`~celery_outbox.store.store.RelayQueries` (no
broker: every claimed row counts as published) and prints the median rate of each
and the hot key's share of the unkeyed rate. It isolates what the claim's head rule
costs; the broker's part of a real drain is the same for every layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import env
from bench.harness import capture_envelopes, drain_once, fill, truncate

#: Layout name -> the ordering key of message number ``i``.
LAYOUTS: dict[str, Callable[[int], str | None]] = {
    "unkeyed": lambda i: None,
    "one key each": lambda i: f"k:{i}",
    "hot key (half)": lambda i: "hot" if i % 2 == 0 else f"k:{i}",
}
#: The layouts of ``make bench``'s keyed drain (issue #20's figures): 10,000 keys,
#: and one hot key holding half the rows beside one key each for the rest.
KEYED_LAYOUTS: dict[str, Callable[[int], str | None]] = {
    "unkeyed": lambda i: None,
    "10,000 keys": lambda i: f"k:{i % 10_000}",
    "hot key (half)": lambda i: "hot" if i % 2 == 0 else f"k:{i}",
}


def laid_out(
    envelopes: Sequence[Any], layouts: dict[str, Callable[[int], str | None]]
) -> dict[str, list[Any]]:
    """The same messages under each layout's ordering keys."""
    return {
        name: [
            dataclasses.replace(e, ordering_key=key(i)) for i, e in enumerate(envelopes)
        ]
        for name, key in layouts.items()
    }


def bench_keyed(sizes: Any, brokers: Any, envelopes: Sequence[Any]) -> str:
    """``make bench``'s keyed drain: one relay process to RabbitMQ, confirms on.

    The layouts take turns, ``sizes.drain_repeats`` rounds; returns the rendered
    table with each layout's median and its share of the unkeyed rate (the target:
    at least half).
    """

    layouts = laid_out(envelopes[: sizes.drain_rows], KEYED_LAYOUTS)
    samples: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(sizes.drain_repeats):
        for name, rows in layouts.items():
            samples[name].append(drain_once("amqp", 1, rows, brokers))
    truncate()
    rates = {name: statistics.median(values) for name, values in samples.items()}
    lines = [
        f"9. keyed drain: {sizes.drain_rows:,} rows -> RabbitMQ, one relay, confirms "
        f"on, tasks/s, median of {sizes.drain_repeats}; share of unkeyed (target >= 50 %)"
    ]
    for name, rate in rates.items():
        share = rate / rates["unkeyed"]
        spread = ", ".join(f"{v:,.0f}" for v in samples[name])
        lines.append(f"  {name:<44} {rate:>10,.0f} /s  {share:>4.0%}  ({spread})")
    return "\n".join(lines)


def drain(envelopes: Sequence[Any], batch: int) -> float:
    """Rows per second to claim and delete every row (the table filled first)."""
    from celery_outbox.outcomes import Settlement
    from celery_outbox.store import Stores

    fill(envelopes)
    store = Stores("default").relay()
    done = 0
    started = time.perf_counter()
    while done < len(envelopes):
        claim = store.claim(batch, 60.0)
        if not claim.messages:
            raise RuntimeError(f"nothing due with {len(envelopes) - done} rows left")
        ids = tuple(m.id for m in claim.messages)
        store.settle(claim.token, Settlement(delete=ids))
        done += len(ids) + len(claim.coalesced)
    return len(envelopes) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    """Run every layout ``--repeats`` times, in turn, and print the medians."""
    parser = argparse.ArgumentParser(prog="python -m bench.ordering")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args(argv)
    env.ensure_database()
    env.setup_django()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    plain = capture_envelopes(args.rows)
    layouts = laid_out(plain, LAYOUTS)
    samples: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.repeats):  # interleaved: the machine's noise hits every layout
        for name, envelopes in layouts.items():
            samples[name].append(drain(envelopes, args.batch))
    rates = {name: statistics.median(values) for name, values in samples.items()}
    for name, rate in rates.items():
        spread = ", ".join(f"{v:,.0f}" for v in samples[name])
        print(f"{name:>16}: {rate:8,.0f} rows/s  ({spread})")
    share = rates["hot key (half)"] / rates["unkeyed"]
    print(f"hot key / unkeyed: {share:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
