"""The handler processor's loop on the in-memory store: no database, real threads."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from celery_outbox.engine.observations import StopReason
from celery_outbox.exceptions import OutboxDatabaseError
from celery_outbox.handlers.observations import MessageHandled
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.outcomes import Action
from celery_outbox.store.handlers import HandlerTables, Lease, MemoryHandlerStore, Row


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


def test_the_observers_hear_each_message_handled() -> None:
    tables = HandlerTables()
    seen: list[Any] = []
    categories = Registry()
    categories.add(Category("org", lambda **_: None))
    emit(tables, "org", "s", 1, {"n": 1})
    processor = Processor(
        ProcessorConfig(
            databases=("memory",), until_empty=True, heartbeat_interval=None
        ),
        categories,
        stores=lambda alias, holder: MemoryHandlerStore(tables, holder=holder),
        observers=[seen.append],
    )

    assert processor.run() is StopReason.EMPTY

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


class NarrowColumns(MemoryHandlerStore):
    """A database that refuses some text :func:`~celery_outbox.text.storable` lets
    through: MySQL's ``last_error`` in a three-byte ``utf8`` column, say, refusing a
    character outside the Basic Multilingual Plane."""

    def retry_later(
        self, lease: Lease, row: Row, attempts: int, delay: float, error: str
    ) -> None:
        _refuse(error)
        super().retry_later(lease, row, attempts, delay, error)

    def dead_letter(
        self, lease: Lease, row: Row, attempts: int, error: str, lease_seconds: float
    ) -> None:
        _refuse(error)
        super().dead_letter(lease, row, attempts, error, lease_seconds)


def _refuse(error: str) -> None:
    if any(ord(char) > 0xFFFF for char in error):
        raise OutboxDatabaseError(
            "handler database 'memory': DataError: (1366, \"Incorrect string value: "
            "'\\xF0\\x9F\\x97\\x8E' for column 'last_error' at row 1\")"
        )


def test_a_failure_whose_text_the_database_refuses_is_charged_with_a_note() -> None:
    tables = HandlerTables()
    runs: list[int] = []

    def unreadable(*, attempt: int, **_: Any) -> None:
        runs.append(attempt)
        raise OSError("cannot read \U0001f5ce report.pdf")

    categories = Registry()
    categories.add(Category("files", unreadable, max_attempts=2, atomic=False))
    emit(tables, "files", "s", 1, {})
    run = Processor(
        ProcessorConfig(
            databases=("memory",),
            poll_interval=0.01,
            retry_base_seconds=0.01,
            until_empty=True,
            heartbeat_interval=None,
        ),
        categories,
        stores=lambda alias, holder: NarrowColumns(tables, holder=holder),
    )

    deadline = time.monotonic() + 5
    while tables.messages and time.monotonic() < deadline:
        run.run_once()
        time.sleep(0.02)

    assert runs == [1, 2]  # each run charged, then the dead letters
    (dead,) = tables.dead
    assert dead.attempts == 2
    assert dead.last_error.startswith(
        "OSError (its text could not be recorded: handler database 'memory': "
        "DataError: (1366, \"Incorrect string value: '\\xF0\\x9F"
    )


def test_stop_ends_a_running_shard_after_the_message_in_hand() -> None:
    tables = HandlerTables()
    ran: list[Any] = []
    categories = Registry()
    run = processor(tables, categories)

    def receive(*, payload: Any, **_: Any) -> None:
        ran.append(payload)
        run.stop()  # SIGTERM while the first message runs

    categories.add(Category("c", receive, coalesce=False))
    for n in range(5):
        emit(tables, "c", "s", n, n)

    assert run.run() is StopReason.SIGNAL

    assert ran == [0]
    assert len(tables.messages) == 4
    shard = tables.shards["s"]
    assert shard.lease_token is None  # given back, due for the next processor


def test_a_payload_that_is_not_json_fails_like_its_receiver_and_stops_nothing() -> None:
    tables = HandlerTables()
    ran: list[Any] = []
    categories = Registry()
    categories.add(
        Category("c", lambda *, payload, **_: ran.append(payload), max_attempts=1)
    )
    MemoryHandlerStore(tables).write("c", "s", "1", "{edited by hand")
    emit(tables, "c", "s", 2, "after")

    assert processor(tables, categories).run() is StopReason.EMPTY

    assert ran == ["after"]
    (dead,) = tables.dead
    assert dead.payload == "{edited by hand" and "JSONDecodeError" in dead.last_error


# -- what a run until empty leaves (#45) ---------------------------------------


def failing(tables: HandlerTables) -> Registry:
    """A category whose receiver always raises, with one message in shard "s"."""
    categories = Registry()

    def receiver(**_: Any) -> None:
        raise KeyError("no such org")

    categories.add(Category("c", receiver))
    emit(tables, "c", "s", 1, "x")
    emit(tables, "c", "s", 2, "y")
    return categories


def test_a_run_that_leaves_a_failing_shard_backing_off_is_unfinished() -> None:
    tables = HandlerTables()
    categories = failing(tables)

    first = processor(tables, categories, retry_base_seconds=60.0)
    assert first.run() is StopReason.UNFINISHED
    # A later run runs nothing (the shard backs off) and is unfinished all the same.
    again = processor(tables, categories, retry_base_seconds=60.0)
    assert again.run() is StopReason.UNFINISHED

    assert again.loop.left.unfinished == (
        "2 message(s) on memory not run: 2 in 1 shard(s) backing off after their "
        "receiver failed (failing longest: shard 's': KeyError: 'no such org')"
    )
    assert again.loop.left.held is None


def test_a_run_that_leaves_only_paused_messages_is_held_naming_the_pauses() -> None:
    tables = HandlerTables()
    categories = Registry()
    categories.add(Category("c", lambda **_: None))
    categories.add(Category("off", lambda **_: None))
    emit(tables, "c", "s", 1, "x")
    emit(tables, "off", "t", 1, "y")
    store = MemoryHandlerStore(tables)
    store.pause("shard", "s")
    store.pause("category", "off")

    run = processor(tables, categories)
    assert run.run() is StopReason.HELD

    assert run.loop.left.unfinished is None
    assert run.loop.left.held == (
        "2 message(s) on memory held by a pause (shard 's', category 'off'; "
        "'outbox handlers resume' lifts it)"
    )


class Unreadable(MemoryHandlerStore):
    """A database that answers the passes, then not when asked what is left."""

    def leftover(self) -> Any:
        raise OutboxDatabaseError("handler database 'memory': gone")


def test_what_is_left_unread_is_unfinished() -> None:
    tables = HandlerTables()
    run = Processor(
        ProcessorConfig(
            databases=("memory",), until_empty=True, heartbeat_interval=None
        ),
        Registry(),
        stores=lambda alias, holder: Unreadable(tables, holder=holder),
    )

    assert run.run() is StopReason.UNFINISHED

    assert run.loop.left.unfinished == (
        "what is left on memory could not be read: handler database 'memory': gone"
    )
