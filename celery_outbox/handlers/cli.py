"""What ``outbox handlers <verb>`` does (its flags are in :mod:`celery_outbox.cli.handlers`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..conf import get_settings


def databases(selected: list[str] | None) -> tuple[str, ...]:
    """The aliases to act on: ``selected``, else every one the processor serves."""
    from .processor import config_from_settings

    chosen = tuple(selected) if selected else None
    return config_from_settings(get_settings(), databases=chosen).databases


def run_processor(
    *,
    selected: list[str] | None,
    lease_seconds: float | None,
    poll_interval: float | None,
    until_empty: bool,
    liveness_file: str | None,
    metrics_port: int | None,
    write: Callable[[str], None],
) -> None:
    """Run the handler processor until it stops (a signal, or empty with ``until_empty``)."""
    from .metrics import processor_observers
    from .processor import Processor, config_from_settings

    config = config_from_settings(
        get_settings(),
        databases=tuple(selected) if selected else None,
        lease_seconds=lease_seconds,
        poll_interval=poll_interval,
        until_empty=until_empty or None,
        liveness_file=liveness_file,
    )
    observers = processor_observers(get_settings(), config.databases, metrics_port)
    try:
        _run(Processor(config, observers=observers), write)
    finally:
        for observer in observers:
            observer.close()


def _run(processor: Any, write: Callable[[str], None]) -> None:
    from ..engine.loop import stop_on_signals

    with stop_on_signals(processor.stop):
        reason = processor.run()
    write(f"handler processor stopped: {reason.value}")


def stats(
    databases: tuple[str, ...], fmt: str, top: int, write: Callable[[str], None]
) -> None:
    """Print the backlog of the handler outboxes on ``databases``."""
    from ..store.handlers.sql import HandlerStore

    reports = [HandlerStore(alias).stats(top) for alias in databases]
    if fmt == "json":
        write(json.dumps([asdict(r) for r in reports], indent=2))
        return
    for r in reports:
        write(f"database {r.database}:")
        write(f"  messages: {r.messages} in {r.shards} shard(s)")
        write(f"  shards waiting for a processor: {r.waiting}")
        write(f"  shards held by a processor: {r.leased}")
        write(f"  blocked shards (head failing): {r.blocked}")
        for b in r.blocked_shards:
            error = (b.last_error.strip().splitlines() or [""])[-1][:200]
            write(
                f"    {b.shard}: {b.category or '?'} message {b.head_id}, "
                f"{b.attempts} attempt(s), failing for {_seconds(b.failing_seconds)}, "
                f"next in {_seconds(b.next_attempt_seconds)}: {error}"
            )
        write(f"  paused shards: {r.paused_shards}")
        write(f"  paused categories: {', '.join(r.paused_categories) or '-'}")
        write(f"  paused shard keys: {', '.join(r.paused_shard_keys) or '-'}")
        write(f"  oldest message (a shard's head): {_seconds(r.oldest_age)}")
        write(f"  processing lag (oldest not blocked or paused): {_seconds(r.lag)}")
        write(f"  dead letters: {r.dead_letters}")
        for name, count in sorted(r.coalesced.items()):
            write(f"  coalesced {name}: {count}")
        if r.deepest:
            write("  deepest shards:")
            for depth in r.deepest:
                write(f"    {depth.shard}: {depth.messages}")


def replay(
    databases: tuple[str, ...],
    *,
    ids: list[int] | None,
    category: str | None,
    shard: str | None,
    write: Callable[[str], None],
) -> None:
    """Write the selected dead letters back at the end of their shards."""
    from ..store.handlers.sql import HandlerStore
    from .registry import registry

    for alias in databases:
        report = HandlerStore(alias).replay(
            ids=ids, category=category, shard=shard, coalesces=registry.coalesces
        )
        line = f"{alias}: {report.replayed} dead letter(s) replayed"
        if report.superseded:
            line += (
                f"; {report.superseded} left (a newer message of their object "
                f"waits in their shard)"
            )
        write(line)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def switch(
    command: str,
    databases: tuple[str, ...],
    *,
    kind: str,
    value: str,
    reason: str,
    write: Callable[[str], None],
) -> None:
    """``pause`` or ``resume`` a category or a shard (``kind``) on every database."""
    from ..store.handlers.sql import HandlerStore

    for alias in databases:
        store = HandlerStore(alias)
        if command == "pause":
            changed = store.pause(kind, value, reason)
            state = "paused" if changed else "already paused"
        else:
            changed = store.resume(kind, value)
            state = "resumed" if changed else "was not paused"
        write(f"{kind} {value!r} on {alias}: {state}")
