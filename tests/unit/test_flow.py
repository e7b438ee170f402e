"""Flow control without a database: the rates read from the settings, the pure
decisions on a clock passed in, the flow store's contract on its in-memory twin, and
the real relay loop holding a flow to its rate on a fake clock."""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from django.test import override_settings

from celery_outbox.app import retried_flow_key
from celery_outbox.broker import InMemoryPublisher
from celery_outbox.checks import check_settings
from celery_outbox.cli.flows import changed_limits
from celery_outbox.conf import load_settings
from celery_outbox.engine.loop import Turn
from celery_outbox.engine.observations import LoopError
from celery_outbox.envelope import Envelope, StoredMessage
from celery_outbox.exceptions import OutboxConfigurationError, OutboxDatabaseError
from celery_outbox.flow.gate import FlowGate, gate_for, plan
from celery_outbox.flow_limits import (
    FLOW_HEADER,
    KEY_HEADER,
    Candidate,
    Decided,
    Flow,
    Grant,
    Rate,
    Use,
    by_key,
    grant,
    limits_in_force,
    parse_limits,
    parse_rate,
    read_limits,
    use_of,
)
from celery_outbox.ordering.gate import KeyGate
from celery_outbox.outcomes import Action, Outcome, PublishResult
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.core import RetryPolicy
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import BatchSettled, RelayObservation
from celery_outbox.store import FlowStore
from celery_outbox.store.memory import InMemoryStore, Tables
from celery_outbox.store.memory_flows import InMemoryFlows

from ..contract.flow_contract import FlowContract
from ..integration.builders import envelope, keyed
from .fakes import FakeClock, FakeWaiter

PARTNER = {"tasks": ["shop.call_partner", "shop.sync_*"], "rate": ["10/s", "100000/d"]}


def flows_setting(value: Any) -> SimpleNamespace:
    return SimpleNamespace(CELERY_OUTBOX_FLOWS=value)


# -- the setting ---------------------------------------------------------------


def test_a_flow_is_read_with_its_tasks_and_every_rate() -> None:
    (partner,) = load_settings(flows_setting({"partner": PARTNER})).flows
    assert partner == Flow(
        "partner",
        ("shop.call_partner", "shop.sync_*"),
        (Rate(10, 1.0), Rate(100_000, 86_400.0)),
    )
    assert partner.covers("shop.sync_stock") and not partner.covers("shop.record")
    assert [str(rate) for rate in partner.rates] == ["10/s", "100000/d"]


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        (
            {"tasks": ["a"], "rate": "20/x"},
            "'20/x' is not a rate: write '<count>/<unit>'",
        ),
        ({"tasks": ["a"], "rate": "0/s"}, "'0/s' lets nothing through"),
        ({"tasks": ["a"], "rate": 20}, "'rate' is a rate such as '10/s'"),
        ({"tasks": ["a"], "rate": [20]}, "a rate is a text such as '10/s'"),
        ({"tasks": ["a"], "rate": ["5/s", "9/s"]}, "names one unit twice"),
        ({"tasks": "shop.call_partner", "rate": "1/s"}, "'tasks' is a list"),
        ({"tasks": [re.compile("shop.*")], "rate": "1/s"}, "regular expressions"),
        ({"tasks": ["a"]}, "needs 'tasks' and at least one limit"),
        ({"tasks": ["a"], "rate": "1/s", "burst": 3}, "unknown: ['burst']"),
        ({"tasks": ["a"], "running": 0}, "'running' is a whole number of at least 1"),
        ({"tasks": ["a"], "queued": "2"}, "'queued' is a whole number of at least 1"),
        ({"tasks": ["a"], "running": True}, "'running' is a whole number"),
        ({"tasks": ["a"], "keys": ["vip"]}, "'keys' is a dict of limits by flow key"),
        (
            {"tasks": ["a"], "keys": {"vip": {"burst": 3}}},
            "'keys' 'vip': a dict with 'running' and/or 'queued'",
        ),
        (
            {"tasks": ["a"], "keys": {"vip": {"running": 0}}},
            "'keys' 'vip': 'running' is a whole number of at least 1",
        ),
        ({"tasks": ["a"], "running": 1, "lease": 0}, "'lease' is the seconds"),
    ],
)
def test_a_misconfigured_flow_is_refused_with_the_fix(
    entry: dict[str, Any], said: str
) -> None:
    with pytest.raises(OutboxConfigurationError) as raised:
        load_settings(flows_setting({"partner": entry}))
    assert str(raised.value).startswith("CELERY_OUTBOX_FLOWS: flow 'partner': ")
    assert said in str(raised.value)


def test_django_start_reports_a_bad_flow_as_the_settings_error() -> None:
    with override_settings(
        CELERY_OUTBOX_FLOWS={"partner": {"tasks": ["a"], "rate": "20/x"}}
    ):
        (error,) = check_settings()
    assert error.id == "celery_outbox.E001"
    assert "with the unit s, m, h or d, e.g. '10/s'" in error.msg


# -- the pure decisions ----------------------------------------------------------


def test_a_window_counts_the_records_younger_than_it() -> None:
    records = [(10.0, 3), (10.5, 2), (11.0, 4)]
    # At 11.0 the record of 10.0 is exactly one second old: it has left the window.
    assert use_of(records, Rate(10, 1.0), 11.0) == Use(Rate(10, 1.0), 6, 0.5)
    assert use_of(records, Rate(10, 1.0), 12.5) == Use(Rate(10, 1.0), 0)
    assert use_of(records, Rate(100, 60.0), 12.5).used == 9


def test_the_grant_is_the_smallest_room_and_the_wait_the_fullest_window() -> None:
    second, day = Rate(10, 1.0), Rate(100, 86_400.0)
    assert grant([Use(second, 4, 0.3), Use(day, 50, 900.0)], 5) == Grant(
        5, rates=(second, day)
    )
    # 6 fit in the second: it is full once they go, and frees when its oldest
    # record (0.3 s old) leaves it, in 0.7 s; then one per 0.1 s.
    found = grant([Use(second, 4, 0.3), Use(day, 50, 900.0)], 9)
    assert (found.granted, found.wait, found.pace) == (6, pytest.approx(0.7), 0.1)
    # The day's window is the one that stops them.
    found = grant([Use(second, 0), Use(day, 98, 86_000.0)], 5)
    assert (found.granted, found.wait, found.pace) == (2, pytest.approx(400.0), 864.0)
    # An empty window that this grant fills frees a whole window from now.
    assert grant([Use(second, 0)], 12).wait == 1.0


def test_rows_held_before_keep_their_slots_and_the_next_wait_behind_them() -> None:
    second = Rate(10, 1.0)
    first = grant([Use(second, 0)], 15)
    # 5 held: the first when the window frees (1 s), one every 0.1 s.
    assert (first.held, first.paced_for) == (5, pytest.approx(1.5))
    # A second batch, 0.2 s later: its rows wait behind those 5 slots.
    later = grant([Use(second, 10, 0.2)], 4, first.paced_for - 0.2)
    assert (later.granted, later.wait, later.held) == (0, pytest.approx(1.3), 4)
    assert later.paced_for == pytest.approx(1.7)


def message(row_id: int, built: Envelope) -> StoredMessage:
    return StoredMessage(row_id, 0, built)


def test_the_plan_admits_the_first_rows_and_paces_the_rest() -> None:
    messages = [
        message(1, envelope("a", task_name="shop.call_partner")),
        message(2, envelope("b", task_name="shop.record")),
        message(3, envelope("c", task_name="shop.call_partner")),
        message(4, envelope("d", task_name="shop.call_partner")),
        message(5, envelope("e", task_name="shop.call_partner")),
    ]
    grants = {"partner": Decided(Grant(1, 0.5, 0.25, (Rate(4, 1.0),)), (1, 3, 4, 5))}
    admission = plan(
        messages,
        lambda name: "partner" if name == "shop.call_partner" else None,
        grants,
    )
    assert [m.id for m in admission.admitted] == [1, 2]
    assert [(d.message_id, d.action, d.delay) for d in admission.held] == [
        (3, Action.RELEASE, 0.5),
        (4, Action.RELEASE, 0.75),
        (5, Action.RELEASE, 1.0),
    ]
    assert admission.held[0].error == "held by flow 'partner' (4/s)"


def test_a_key_stays_in_order_behind_a_held_row() -> None:
    messages = [
        message(1, keyed("a", "org:1", task="shop.call_partner")),
        message(2, keyed("b", "org:1", task="shop.call_partner")),
        message(3, keyed("c", "org:1", task="shop.record")),
        message(4, keyed("d", "org:2", task="shop.record")),
    ]
    admission = plan(
        messages,
        lambda name: "partner" if name == "shop.call_partner" else None,
        {"partner": Decided(Grant(1, 1.0, 1.0, (Rate(1, 1.0),)), (1, 2))},
    )
    # Row 3 has no flow, but publishing it before row 2 would reorder org:1.
    assert [m.id for m in admission.admitted] == [1, 4]
    assert [(d.message_id, d.delay) for d in admission.held] == [(2, 1.0), (3, 0.0)]


# -- the gate --------------------------------------------------------------------


def test_no_flow_configured_is_ordered_keys_gate_alone() -> None:
    gate = gate_for(
        load_settings(SimpleNamespace(CELERY_OUTBOX_STRICT_LEASE_SECONDS=42)),
        InMemoryFlows(),
    )
    assert type(gate) is KeyGate and gate.running_seconds == 42.0


def test_rows_of_no_flow_cost_the_gate_no_decision() -> None:
    store = InMemoryFlows(FakeClock())
    partner = load_settings(flows_setting({"partner": PARTNER})).flows
    gate = FlowGate(partner, store)
    rows = [message(i, envelope(str(i))) for i in range(1, 4)]
    assert gate.admit(rows).admitted == tuple(rows)
    assert store.records == {} and store.changed == {}


def test_a_row_that_takes_a_slot_goes_out_naming_the_flow_of_the_slot() -> None:
    # Sent with a flow key before the flow was configured (no flow header), or
    # under other settings (another flow): the worker reports its start and end to
    # the flow its headers name.
    tables = Tables(FakeClock())
    outbox = InMemoryStore(tables=tables)
    keyed_partner = {"tasks": ["shop.call_partner"], "running": 1}
    flows = load_settings(flows_setting({"partner": keyed_partner})).flows
    task = {"task": "shop.call_partner"}
    outbox.add(
        [
            envelope("old", task_name=task["task"], headers=task | {KEY_HEADER: "a"}),
            envelope(
                "other",
                task_name=task["task"],
                headers=task | {KEY_HEADER: "b", FLOW_HEADER: "x"},
            ),
            envelope("free"),
        ]
    )
    claim = outbox.claim(50, 30.0)
    gate = FlowGate(flows, InMemoryFlows(tables=tables))
    admitted = gate.admit(claim.messages, claim.token).admitted
    sent = {m.envelope.task_id.split("-")[0]: m.envelope.headers for m in admitted}
    assert sent["old"][FLOW_HEADER] == "partner"
    assert sent["other"][FLOW_HEADER] == "partner"
    assert FLOW_HEADER not in sent["free"]


def test_a_row_that_takes_a_slot_goes_out_with_no_ttl_the_broker_would_drop_it_by() -> (
    None
):
    # RabbitMQ drops a message whose TTL passed without telling anyone: its slot
    # would wait for the lease. Its ``expires`` header still expires it on the
    # worker, which reports it (task_revoked, expired).
    tables = Tables(FakeClock())
    outbox = InMemoryStore(tables=tables)
    keyed_partner = {"tasks": ["shop.call_partner"], "running": 1}
    flows = load_settings(flows_setting({"partner": keyed_partner})).flows
    task = {"task": "shop.call_partner", "expires": "2026-01-02T03:04:05+00:00"}
    ttl = {"delivery_mode": 2, "expiration": "1000"}
    outbox.add(
        [
            envelope(
                "keyed",
                task_name=task["task"],
                headers=task | {KEY_HEADER: "a", FLOW_HEADER: "partner"},
                properties=ttl,
            ),
            envelope("unkeyed", task_name=task["task"], headers=task, properties=ttl),
            envelope(
                "bare",
                task_name=task["task"],
                headers={"task": task["task"], KEY_HEADER: "b"},
                properties=ttl,
            ),
        ]
    )
    claim = outbox.claim(50, 30.0)
    gate = FlowGate(flows, InMemoryFlows(tables=tables))
    admitted = gate.admit(claim.messages, claim.token).admitted
    sent = {m.envelope.task_id.split("-")[0]: m.envelope for m in admitted}
    assert sent["keyed"].properties == {"delivery_mode": 2}
    assert sent["keyed"].headers["expires"] == task["expires"]
    # No slot, nothing to free: the broker's TTL stays.
    assert sent["unkeyed"].expiration == "1000"
    # A TTL with no expires header (a raw ``expiration=``): no worker would
    # expire it, the TTL is all there is.
    assert sent["bare"].expiration == "1000"


# -- the store's contract, on the twin -------------------------------------------


class MemoryFlows:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.tables = Tables(self.clock)
        self.flows = InMemoryFlows(tables=self.tables)
        self.outbox = InMemoryStore(tables=self.tables)

    def store_for_thread(self) -> FlowStore:
        return self.flows

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        self.outbox.add(envelopes)

    def wait(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def claim(self, limit: int) -> tuple[str, Sequence[StoredMessage]]:
        found = self.outbox.claim(limit, 30.0)
        return found.token, found.messages


@pytest.fixture
def flows() -> MemoryFlows:
    return MemoryFlows()


class TestInMemoryFlows(FlowContract):
    """The twin keeps the SQL store's promises."""


# -- the relay loop --------------------------------------------------------------


class RelayWorld:
    """A relay with a flow gate, all in memory, on a fake clock; what it published when."""

    def __init__(self, rates: list[str], batch_size: int = 50, relays: int = 1) -> None:
        self.clock = FakeClock()
        self.tables = Tables(self.clock)
        self.store = InMemoryStore(tables=self.tables)
        self.flows = InMemoryFlows(tables=self.tables)
        self.publisher = InMemoryPublisher()
        self.sent: list[tuple[float, str]] = []
        self.released = 0
        config = RelayConfig(
            batch_size=batch_size,
            lease_seconds=30.0,
            poll_interval=1.0,
            send_timeout=10.0,
            policy=RetryPolicy(3, 1.0, 4.0, 5.0),
        )
        settings = load_settings(
            flows_setting({"partner": {"tasks": ["shop.call_partner"], "rate": rates}})
        )
        # Relays of their own (their own breaker, suspects, gate object) on one
        # outbox and one flow store, as relays in several processes on one database.
        self.relays = [
            Relay(
                self.store,
                self.publisher,
                config,
                clock=self.clock,
                waiter=FakeWaiter(self.clock),
                observers=[self.observe],
                gate=gate_for(settings, self.flows),
            )
            for _ in range(relays)
        ]
        self.relay = self.relays[0]

    def observe(self, event: RelayObservation) -> None:
        if isinstance(event, BatchSettled):
            self.released += len(event.settlement.release)
            self.sent.extend(
                (self.clock(), m.envelope.task_name)
                for m, r in zip(
                    [m for m in event.messages if m.id in set(event.settlement.delete)],
                    [r for r in event.results if r.outcome is Outcome.PUBLISHED],
                    strict=True,
                )
            )

    def drain(self, limit: float = 600.0) -> None:
        """Turn the relay, resting until the next row is due, until the outbox is empty."""
        start = self.clock()
        while self.store.pending() and self.clock() - start < limit:
            turns = [relay.run_once() for relay in self.relays]
            if all(turn is Turn.EMPTY for turn in turns):
                self.clock.advance(max(self.relay.next_due(), 0.001))
            else:
                self.clock.advance(0.001)  # a batch takes time


def most_in_any_window(times: list[float], seconds: float) -> int:
    return max(sum(1 for t in times if start <= t < start + seconds) for start in times)


def test_the_relay_holds_a_flow_to_its_rate_in_every_window_and_uses_it() -> None:
    world = RelayWorld(["20/s"])
    world.store.add(envelope(str(i), task_name="shop.call_partner") for i in range(100))
    world.store.add(envelope(f"free-{i}") for i in range(30))
    start = world.clock()
    world.drain()
    partner = [t for t, name in world.sent if name == "shop.call_partner"]
    free = [t for t, name in world.sent if name == "shop.record"]
    assert len(partner) == 100 and len(free) == 30
    assert most_in_any_window(partner, 1.0) <= 20
    # The limit is used: 100 at 20/s take 4 to 5 seconds, not more.
    assert 4.0 <= max(partner) - start <= 5.5
    # The rows of no flow went in the first batches, whatever the flow held.
    assert max(free) - start < 0.1
    # Held rows came back without an attempt used, none of them dead.
    assert world.tables.dead == {}


def test_two_relays_hold_one_rate_between_them() -> None:
    world = RelayWorld(["20/s"], batch_size=100, relays=2)
    world.store.add(envelope(str(i), task_name="shop.call_partner") for i in range(300))
    start = world.clock()
    world.drain()
    times = [t for t, _ in world.sent]
    assert len(times) == 300
    assert most_in_any_window(times, 1.0) <= 20
    assert 14.0 <= max(times) - start <= 15.5
    # The relays share the slots: no row is held again and again.
    assert world.released <= 300


def test_a_backlog_held_over_many_batches_comes_back_once_at_the_rate() -> None:
    world = RelayWorld(["20/s"], batch_size=10)
    world.store.add(envelope(str(i), task_name="shop.call_partner") for i in range(100))
    start = world.clock()
    world.drain()
    times = [t for t, _ in world.sent]
    assert len(times) == 100 and most_in_any_window(times, 1.0) <= 20
    assert 4.0 <= max(times) - start <= 5.5
    # 80 rows wait for a later window: each is held once, given its slot behind the
    # batches held before it, not sent back every second with everyone else.
    assert world.released <= 85


def test_held_rows_use_no_attempt_and_say_which_flow_holds_them() -> None:
    world = RelayWorld(["2/m"])
    ids = world.store.add(
        envelope(str(i), task_name="shop.call_partner") for i in range(5)
    )
    assert world.relay.run_once() is Turn.PARTIAL
    waiting = {row.id: row for row in world.store.rows}
    assert sorted(waiting) == ids[2:]
    assert {(r.attempts, r.last_error) for r in waiting.values()} == {
        (0, "held by flow 'partner' (2/m)")
    }
    # Due when the minute's window frees, one every 30 s after that.
    due = sorted(r.available_at - world.clock() for r in waiting.values())
    assert due == pytest.approx([60.0, 90.0, 120.0])


def test_an_operator_rate_holds_on_the_relay_at_its_next_batch() -> None:
    world = RelayWorld(["1/m"], batch_size=10)
    world.flows.set_rates("partner", (parse_rate("5/s"),))
    world.store.add(envelope(str(i), task_name="shop.call_partner") for i in range(10))
    world.relay.run_once()
    assert len(world.publisher.published) == 5


class DownFlows(InMemoryFlows):
    """A flow store whose database is down: every decision fails as the SQL one's
    would, translated at the boundary."""

    def reserve(self, flow: Flow, wanted: int) -> Grant:
        raise OutboxDatabaseError("outbox database 'default': OperationalError: gone")


def test_a_gate_that_cannot_decide_hands_the_batch_back_unsent() -> None:
    world = RelayWorld(["5/s"])
    errors: list[LoopError] = []
    world.relay.observers.append(
        lambda event: errors.append(event) if isinstance(event, LoopError) else None
    )
    partner = Flow("partner", ("shop.call_partner",), (Rate(5, 1.0),))
    world.relay.gate = FlowGate([partner], DownFlows())
    world.store.add(envelope(str(i), task_name="shop.call_partner") for i in range(3))
    world.relay.run_once()
    assert world.publisher.published == []
    assert [e.stage for e in errors] == ["gate"]
    rows = world.store.rows
    # Back after the relay's error pause, no attempt used, no error of theirs.
    assert [(r.attempts, r.lease_token, r.last_error) for r in rows] == [
        (0, None, "")
    ] * 3
    pause = world.relay.config.error_pause
    assert [r.available_at - world.clock() for r in rows] == [pytest.approx(pause)] * 3


# -- limits per key, with the real relay loop and a worker that reports ----------


class KeyedWorld:
    """A relay with a flow of limits per key, and workers that run what it
    publishes for ``run_for`` seconds each and report starts and ends, as
    ``celery_outbox.flow.worker`` does, on a fake clock."""

    def __init__(self, entry: dict[str, Any], processes: int, run_for: float) -> None:
        self.clock = FakeClock()
        self.tables = Tables(self.clock)
        self.store = InMemoryStore(tables=self.tables)
        self.flows = InMemoryFlows(tables=self.tables)
        self.publisher = InMemoryPublisher()
        settings = load_settings(flows_setting({"partner": entry}))
        (self.flow,) = settings.flows
        self.relay = Relay(
            self.store,
            self.publisher,
            RelayConfig(
                batch_size=50,
                lease_seconds=30.0,
                poll_interval=1.0,
                send_timeout=10.0,
                policy=RetryPolicy(3, 1.0, 4.0, 5.0),
            ),
            clock=self.clock,
            waiter=FakeWaiter(self.clock),
            gate=gate_for(settings, self.flows),
        )
        self.processes = processes
        self.run_for = run_for
        self.queue: list[Envelope] = []  # the broker's queue
        self.running: list[tuple[float, Envelope]] = []  # (ends at, task)
        #: (key, start, end) of every run.
        self.runs: list[tuple[str, float, float]] = []

    def send(self, key: str, count: int) -> None:
        self.store.add(
            envelope(
                f"{key}{i}", task_name="shop.call_partner", headers={KEY_HEADER: key}
            )
            for i in range(count)
        )

    def work(self) -> None:
        """End what is due, then start what the free processes can."""
        now = self.clock()
        for ends, task in [r for r in self.running if r[0] <= now]:
            self.running.remove((ends, task))
            key = str(task.headers[KEY_HEADER])
            self.runs.append((key, ends - self.run_for, ends))
            self.flows.task_ended(self.flow, key, task.task_id)
        self.queue.extend(self.publisher.published)
        self.publisher.published.clear()
        while self.queue and len(self.running) < self.processes:
            task = self.queue.pop(0)
            self.flows.task_started(
                self.flow, str(task.headers[KEY_HEADER]), task.task_id
            )
            self.running.append((now + self.run_for, task))

    def drain(self, limit: float = 300.0) -> None:
        start = self.clock()
        while (self.store.pending() or self.queue or self.running) and (
            self.clock() - start < limit
        ):
            self.relay.run_once()
            self.work()
            self.clock.advance(0.01)

    def most_at_once(self, key: str) -> int:
        spans = [(s, e) for k, s, e in self.runs if k == key]
        return max(sum(1 for s, e in spans if s <= at < e) for at, _ in spans)


def test_a_key_runs_at_most_its_running_limit_and_the_others_go_past_it() -> None:
    world = KeyedWorld({"tasks": ["shop.call_partner"], "running": 2}, 8, 0.5)
    for key in ("a", "b", "c"):
        world.send(key, 8)
    start = world.clock()
    world.drain()
    assert len(world.runs) == 24 and world.tables.rows == {}
    assert [world.most_at_once(key) for key in "abc"] == [2, 2, 2]
    # The relay published past a capped key: the three keys ran side by side,
    # 6 at once, and the 24 tasks took 4 turns of 0.5 s, not 12.
    assert max(end for _, _, end in world.runs) - start < 2.5


def test_a_quiet_key_starts_at_once_behind_a_noisy_backlog() -> None:
    world = KeyedWorld({"tasks": ["shop.call_partner"], "queued": 2}, 2, 0.05)
    world.send("noisy", 2000)
    for _ in range(100):  # 1 s: the noisy backlog is in the outbox, 2 in the queue
        world.relay.run_once()
        world.work()
        world.clock.advance(0.01)
    sent_at = world.clock()
    world.send("quiet", 5)
    world.drain(limit=20.0)
    quiet = sorted(start for key, start, _ in world.runs if key == "quiet")
    assert len(quiet) == 5
    # Behind at most 2 queued noisy tasks, not 2,000: within a few runs of 0.05 s.
    assert quiet[-1] - sent_at < 1.0


def test_a_retry_keeps_its_key_and_a_task_it_sends_does_not() -> None:
    request = SimpleNamespace(id="t-1", outbox_flow_key="tenant-42", headers=None)
    running = SimpleNamespace(request=request)
    assert retried_flow_key(running, "t-1") == "tenant-42"
    assert retried_flow_key(running, "t-2") is None
    eager = SimpleNamespace(id="t-1", headers={KEY_HEADER: "tenant-7"})
    assert retried_flow_key(SimpleNamespace(request=eager), "t-1") == "tenant-7"


def test_a_row_the_relay_dead_letters_frees_its_keys_slot_at_once() -> None:
    world = KeyedWorld({"tasks": ["shop.call_partner"], "running": 1}, 4, 0.5)
    refused = "a0"

    def broker(message: StoredMessage) -> PublishResult | None:
        if message.envelope.task_id.startswith(refused):
            return PublishResult(message.id, Outcome.FAILED, "406 PRECONDITION_FAILED")
        return None

    world.publisher.behaviour = broker
    world.send("a", 2)
    start = world.clock()
    world.drain(limit=60.0)
    # a0 was refused 3 times (backoff 1-4 s) and dead-lettered; a1 did not wait
    # for the lease (300 s) of the slot a0 took and never used.
    assert [key for key, _, _ in world.runs] == ["a"]
    assert world.runs[0][1] - start < 10.0
    assert len(world.store.dead) == 1


# -- an operator's limits: the order stored is the order decided -----------------


def test_a_key_named_by_command_goes_first_and_its_keys_get_the_limit_printed() -> None:
    settings = parse_limits(
        {"running": 2, "keys": {"premium-gold-*": {"running": 6}, "premium-*": {}}}
    )
    changed = changed_limits(settings, "premium-7", {"running": 1}, reset=False)
    assert changed is not None
    stored = limits_in_force(Flow("f", ("t",), (), settings), changed.text())
    assert [p for p, _ in stored.keys] == ["premium-7", "premium-gold-*", "premium-*"]
    rows = [Candidate(i, "premium-7", f"t{i}") for i in range(4)]
    assert len(by_key(rows, stored, {}).free) == 1
    # A key changed again goes first again; the every-key limit changes no key's.
    again = changed_limits(stored, "premium-*", {"running": 5}, reset=False)
    assert again is not None
    assert [p for p, _ in again.keys] == ["premium-*", "premium-7", "premium-gold-*"]
    every = changed_limits(settings, None, {"running": 3}, reset=False)
    assert every is not None
    kept = limits_in_force(Flow("f", ("t",), (), settings), every.text())
    assert kept.of("premium-gold-1").running == 6
    assert [p for p, _ in kept.keys] == ["premium-gold-*", "premium-*"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"runing": 3}, "unknown: ['runing']"),
        ({}, "sets no limit"),
        ({"keys": {"": {"running": 1}}}, "keyed by flow keys or glob patterns"),
        ([1], "limits per key are a dict"),
    ],
)
def test_an_operators_limits_are_checked_as_the_settings_are(
    value: Any, said: str
) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        read_limits(value)
    assert said in str(raised.value)
