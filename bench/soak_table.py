"""The soak's figures (bench.soak): the outbox table's size, one line per interval.

Sizes come from PostgreSQL itself: ``pg_relation_size`` of the table and of each
index, ``pg_total_relation_size`` (TOAST included), the dead and live tuples and the
autovacuum runs of ``pg_stat_user_tables``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TABLE = "celery_outbox_message"
MB = 1024 * 1024

#: The per-table settings ``--autovacuum recommended`` sets (see
#: docs/operations.md): vacuum after a fixed number of dead rows, not a fraction of
#: a live set that stays small, without the cost-based pauses, and never truncate
#: the table (the truncation's exclusive lock stops every claim and INSERT).
RECOMMENDED = {
    "autovacuum_vacuum_scale_factor": "0.0",
    "autovacuum_vacuum_threshold": "10000",
    "autovacuum_vacuum_cost_delay": "0",
    "vacuum_truncate": "false",
}
#: The server settings that decide when autovacuum visits the table, printed first.
SERVER_SETTINGS = (
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_max_workers",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_vacuum_cost_delay",
    "autovacuum_vacuum_cost_limit",
)


@dataclass(frozen=True)
class Sizes:
    """The outbox table's size and vacuum state at one moment."""

    table: int
    total: int
    indexes: dict[str, int]
    dead: int
    live: int
    autovacuums: int


def read_sizes() -> Sizes:
    """The outbox table's sizes and counters now."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_relation_size(%s::regclass), pg_total_relation_size(%s::regclass)",
            [TABLE, TABLE],
        )
        table, total = cursor.fetchone()
        cursor.execute(
            "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) "
            "FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1",
            [TABLE],
        )
        indexes = {str(name): int(size) for name, size in cursor.fetchall()}
        cursor.execute(
            "SELECT n_dead_tup, n_live_tup, autovacuum_count "
            "FROM pg_stat_user_tables WHERE relid = %s::regclass",
            [TABLE],
        )
        dead, live, autovacuums = cursor.fetchone()
    return Sizes(
        int(table), int(total), indexes, int(dead), int(live), int(autovacuums)
    )


def set_autovacuum(recommended: bool) -> None:
    """Set :data:`RECOMMENDED` on the table, or reset it to the server's settings."""
    from django.db import connection

    with connection.cursor() as cursor:
        if recommended:
            options = ", ".join(f"{k} = {v}" for k, v in RECOMMENDED.items())
            cursor.execute(f"ALTER TABLE {TABLE} SET ({options})")
        else:
            cursor.execute(f"ALTER TABLE {TABLE} RESET ({', '.join(RECOMMENDED)})")


def autovacuum_settings() -> str:
    """The server's autovacuum settings and the table's own, as printed lines."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
            [list(SERVER_SETTINGS)],
        )
        server = [
            f"{name}={value}{unit or ''}" for name, value, unit in cursor.fetchall()
        ]
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [TABLE])
        (options,) = cursor.fetchone()
    text = (
        f"server: {', '.join(server)}\n"
        f"table {TABLE}: {', '.join(options or []) or 'no per-table settings'}"
    )
    if "autovacuum=off" in server:
        text += (
            "\nWARNING: autovacuum is off on this server: nothing vacuums the table, "
            "which grows with every message. Point OUTBOX_BENCH_PG_PORT at a server "
            "with autovacuum on (PostgreSQL's default) to measure it."
        )
    return text


def _ms(values: Sequence[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1] * 1000


@dataclass(frozen=True)
class Sample:
    """One line of the soak's table: the interval that ended at ``at``."""

    at: float
    elapsed: float
    enqueued: int
    published: int
    backlog: int
    produced: float
    drain: float
    claim_p50_ms: float
    claim_p99_ms: float
    settle_p99_ms: float
    claims: int
    sizes: Sizes
    notes: list[str] = field(default_factory=list)

    @classmethod
    def first(cls, sizes: Sizes, at: float) -> Sample:
        """The state before the first message."""
        nan = float("nan")
        return cls(at, 0.0, 0, 0, 0, 0.0, 0.0, nan, nan, nan, 0, sizes)

    def next(
        self,
        now: float,
        started: float,
        counts: tuple[int, int, int],
        window: tuple[list[float], list[float], int],
        sizes: Sizes,
    ) -> Sample:
        """The sample after this one: ``counts`` (enqueued, published, backlog) and
        ``window`` (claim and settle seconds, rows claimed) of the interval."""
        enqueued, published, backlog = counts
        claims, settles, _ = window
        seconds = max(now - self.at, 1e-9)
        return Sample(
            now,
            now - started,
            enqueued,
            published,
            backlog,
            (enqueued - self.enqueued) / seconds,
            (published - self.published) / seconds,
            _ms(claims, 50),
            _ms(claims, 99),
            _ms(settles, 99),
            len(claims),
            sizes,
        )


HEADER = (
    f"{'elapsed s':>9} {'enqueued':>9} {'published':>9} {'backlog':>7} {'enq/s':>7} "
    f"{'drain/s':>7} "
    f"{'claim p50':>9} {'p99 ms':>7} {'settle p99':>10} {'table MB':>8} "
    f"{'index MB':>8} {'total MB':>8} {'dead':>8} {'autovac':>7}"
)


def render_line(sample: Sample | None) -> str:
    """A line of the table (the header for None)."""
    if sample is None:
        return HEADER
    s = sample.sizes
    return (
        f"{sample.elapsed:9.0f} {sample.enqueued:9,d} {sample.published:9,d} "
        f"{sample.backlog:7,d} {sample.produced:7,.0f} {sample.drain:7,.0f} "
        f"{sample.claim_p50_ms:9.1f} "
        f"{sample.claim_p99_ms:7.1f} {sample.settle_p99_ms:10.1f} {s.table / MB:8.1f} "
        f"{sum(s.indexes.values()) / MB:8.1f} {s.total / MB:8.1f} {s.dead:8,d} "
        f"{s.autovacuums:7d}"
    )


def render_summary(samples: Sequence[Sample], count: int, published: int) -> str:
    """Start against end: medians of the first and the last third of the run.

    The first minute is left out (the table and its indexes grow to their working
    size there), as is the last line (the producer has stopped: a partial interval).
    """
    steady = [s for s in samples[:-1] if s.elapsed > 60] or list(samples)
    third = max(1, len(steady) // 3)
    head, tail = steady[:third], steady[-third:]

    def pair(name: str, get: Any, unit: str) -> str:
        a = statistics.median(get(s) for s in head)
        b = statistics.median(get(s) for s in tail)
        ratio = b / a if a else float("nan")
        peak = max(get(s) for s in steady)
        return f"  {name:<16} {a:10,.1f} {b:10,.1f} {ratio:7.2f} {peak:10,.1f} {unit}"

    lines = [
        f"published {published:,} of {count:,} (RabbitMQ's count, purges summed)",
        f"  {'':<16} {'first third':>10} {'last third':>10} {'ratio':>7} {'max':>10}",
        pair("enqueued", lambda s: s.produced, "/s"),
        pair("drain", lambda s: s.drain, "/s"),
        pair("claim p50", lambda s: s.claim_p50_ms, "ms"),
        pair("claim p99", lambda s: s.claim_p99_ms, "ms"),
        pair("settle p99", lambda s: s.settle_p99_ms, "ms"),
        pair("table", lambda s: s.sizes.table / MB, "MB"),
        pair("indexes", lambda s: sum(s.sizes.indexes.values()) / MB, "MB"),
        pair("total", lambda s: s.sizes.total / MB, "MB"),
        pair("dead tuples", lambda s: s.sizes.dead, ""),
        pair("backlog", lambda s: s.backlog, "rows"),
    ]
    last = samples[-1].sizes if samples else None
    if last is not None:
        each = ", ".join(f"{k} {v / MB:.1f}" for k, v in last.indexes.items())
        lines.append(f"indexes at the end (MB): {each}")
        lines.append(f"autovacuum runs on the table: {last.autovacuums}")
    return "\n".join(lines)
