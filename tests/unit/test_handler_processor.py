"""The handler processor's loop on the in-memory store: no database, real threads."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from celery_outbox.engine.observations import StopReason
from celery_outbox.handlers.observations import MessageHandled
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.outcomes import Action
from celery_outbox.store.handlers import HandlerTables, MemoryHandlerStore


def emit(
    tables: HandlerTables, category: str, shard: str, obj: Any, payload: Any
) -> None:
    MemoryHandlerStore(tables).write(category, shard, str(obj), json.dumps(payload))


def processor(tables: HandlerTables, categories: Registry, **changes: Any) -> Processor:
    options: dict[str, Any] = {
        "databases": ("memory",),
        "poll_interval": 0.01,
        "retry_base_seconds": 0.05,
        "until_empty": True,
        "heartbeat_interval": None,
    }
    options.update(changes)
    return Processor(
        ProcessorConfig(**options),
        categories,
        stores=lambda alias, holder: MemoryHandlerStore(tables, holder=holder),
        random_source=lambda: 1.0,
    )


def test_receivers_run_in_shard_order_and_only_an_objects_newest_payload() -> None:
    tables = HandlerTables()
    seen: list[tuple[str, Any]] = []
    categories = Registry()
    categories.add(
        Category(
            "org", lambda *, object_id, payload, **_: seen.append((object_id, payload))
        )
    )
    for n in range(20):  # four reads of five, each object in all of them
        emit(tables, "org", "s", n % 2, n)

    assert processor(tables, categories, window=5).run() is StopReason.EMPTY

    assert seen == [("0", 18), ("1", 19)]
    assert tables.messages == {} and tables.coalesced == {"org": 18}


def test_a_failing_head_is_retried_then_dead_lettered_and_the_shard_goes_on() -> None:
    tables = HandlerTables()
    tries: list[Any] = []
    observed: list[Any] = []

    def flaky(*, payload: Any, attempt: int, **_: Any) -> None:
        tries.append((payload, attempt))
        if payload == "poison":
            raise ValueError("poison")

    categories = Registry()
    categories.add(Category("c", flaky, coalesce=False, max_attempts=3))
    emit(tables, "c", "s", 1, "poison")
    emit(tables, "c", "s", 2, "fine")
    run = processor(tables, categories)
    run.observers.append(observed.append)

    deadline = time.monotonic() + 5
    while tables.messages and time.monotonic() < deadline:
        run.run_once()
        time.sleep(0.02)

    assert tries == [("poison", 1), ("poison", 2), ("poison", 3), ("fine", 1)]
    assert [d.payload for d in tables.dead] == ['"poison"']
    actions = [o.action for o in observed if isinstance(o, MessageHandled)]
    assert actions == [Action.RETRY, Action.RETRY, Action.DEAD_LETTER, Action.DELETE]


def test_an_atomic_receiver_that_raises_leaves_its_message() -> None:
    tables = HandlerTables()
    categories = Registry()

    def broken(**_: Any) -> None:
        raise RuntimeError("no")

    categories.add(Category("c", broken, max_attempts=None))
    emit(tables, "c", "s", 1, {})
    processor(tables, categories).run_once()
    assert len(tables.messages) == 1
    assert (
        tables.shards["s"].attempts == 1
        and "RuntimeError: no" in tables.shards["s"].last_error
    )


def test_stop_ends_an_idle_processor_at_once() -> None:
    run = processor(HandlerTables(), Registry(), until_empty=False, poll_interval=30.0)
    reasons: list[StopReason] = []
    worker = threading.Thread(target=lambda: reasons.append(run.run()))
    worker.start()
    time.sleep(0.2)
    started = time.monotonic()
    run.stop()
    worker.join(5)
    assert reasons == [StopReason.SIGNAL]
    assert time.monotonic() - started < 1


def test_a_dead_processors_shard_is_taken_over_by_the_heartbeat() -> None:
    tables = HandlerTables()
    ran: list[Any] = []
    categories = Registry()
    categories.add(Category("c", lambda *, payload, **_: ran.append(payload)))
    emit(tables, "c", "s", 1, "once")
    dead = MemoryHandlerStore(tables, holder="dead")
    dead.beat("dead", "dead:1")
    assert dead.claim("t", 300.0) is not None
    run = processor(tables, categories, until_empty=False, heartbeat_interval=0.05)
    worker = threading.Thread(target=run.run)
    started = time.monotonic()
    worker.start()
    try:
        while not ran and time.monotonic() - started < 5:
            time.sleep(0.01)
    finally:
        run.stop()
        worker.join(5)
    assert ran == ["once"]
    assert time.monotonic() - started < 2  # three beats, not the 300 s lease
    assert tables.processors == {}  # the dead one taken over, the live one left


def test_the_old_listeners_keyword_still_reaches_the_observers() -> None:
    tables = HandlerTables()
    seen: list[Any] = []
    categories = Registry()
    categories.add(Category("org", lambda **_: None))
    emit(tables, "org", "s", 1, {"n": 1})
    with pytest.warns(DeprecationWarning, match=r"use Processor\(observers=\.\.\.\)"):
        old = Processor(
            ProcessorConfig(
                databases=("memory",), until_empty=True, heartbeat_interval=None
            ),
            categories,
            stores=lambda alias, holder: MemoryHandlerStore(tables, holder=holder),
            listeners=[seen.append],
        )

    assert old.run() is StopReason.EMPTY

    assert [e.action for e in seen if isinstance(e, MessageHandled)] == [Action.DELETE]


def test_a_long_pass_keeps_the_liveness_file_fresh(tmp_path: Path) -> None:
    # One pass drains every due shard, one after the other: with a backlog it may
    # take minutes, and a liveness probe must not take the busy processor for a
    # stuck one.
    alive = tmp_path / "alive"
    alive.touch()
    now = [1000.0]
    touched: list[float] = []

    def slow(**_: Any) -> None:
        now[0] += 2.0  # each receiver takes two seconds of the processor's clock
        touched.append(alive.stat().st_mtime)

    tables = HandlerTables()
    categories = Registry()
    categories.add(Category("c", slow, coalesce=False))
    for n in range(10):
        emit(tables, "c", f"s{n}", n, n)
    run = Processor(
        ProcessorConfig(
            databases=("memory",), liveness_file=str(alive), heartbeat_interval=None
        ),
        categories,
        monotonic=lambda: now[0],
        stores=lambda alias, holder: MemoryHandlerStore(tables, holder=holder),
    )
    os.utime(alive, (1.0, 1.0))  # last touched long ago

    assert run.run_once() == 10  # one pass, ten shards, twenty seconds
    assert touched[-1] > time.time() - 60, "the file was not touched during the pass"
