"""The contract of flow control's store (:class:`~celery_outbox.store.FlowStore`).

Written against the protocol and a :class:`FlowHarness`;
``tests/integration/test_flow_contract.py`` runs it on every database alias (real
time: each test waits about a second at most), ``tests/unit/test_flow.py`` on the
in-memory twin (a fake clock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import pytest

from celery_outbox.envelope import Envelope, StoredMessage
from celery_outbox.flow.gate import candidate
from celery_outbox.flow_limits import (
    KEY_HEADER,
    Decided,
    Flow,
    KeyLimit,
    Limits,
    parse_limits,
    parse_rate,
)
from celery_outbox.store import FlowStore

from ..integration.builders import envelope


class FlowHarness(Protocol):
    """One backend's flow store, beside the outbox its stats count."""

    flows: FlowStore

    def store_for_thread(self) -> FlowStore:
        """A flow store a new thread may use (its own connection)."""
        ...

    def enqueue(self, envelopes: Sequence[Envelope]) -> None:
        """Commit outbox rows."""
        ...

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock."""
        ...

    def claim(self, limit: int) -> tuple[str, Sequence[StoredMessage]]:
        """Lease up to ``limit`` due rows, as a relay: its token and the rows."""
        ...


def flow(name: str = "partner", *rates: str, tasks: tuple[str, ...] = ()) -> Flow:
    return Flow(
        name,
        tasks or ("shop.call_partner", "shop.sync_*"),
        tuple(parse_rate(r) for r in rates or ("5/s",)),
    )


def of_key(tag: str, key: str, task_name: str = "shop.call_partner") -> Envelope:
    """A task of ``task_name`` sent with ``flow_key=key``."""
    return envelope(
        tag, task_name=task_name, headers={"task": task_name, KEY_HEADER: key}
    )


def keyed_flow(
    lease: float = 300.0, rates: tuple[str, ...] = (), **limits: object
) -> Flow:
    return Flow(
        "partner",
        ("shop.call_partner",),
        tuple(parse_rate(r) for r in rates),
        parse_limits(limits),
        lease,
    )


def tags(messages: Sequence[StoredMessage]) -> list[str]:
    return sorted(m.envelope.task_id.split("-")[0] for m in messages)


#: Pairs of keys or names MySQL/MariaDB's default collation (``utf8mb4_general_ci``)
#: takes for one: case, an accent, a trailing space (it pads), two emoji (it weighs
#: every character past U+FFFF alike).
SPELLINGS = (("Tenant-A", "tenant-a"), ("café", "cafe"), ("t", "t "), ("🍎", "🍐"))


class FlowContract:
    """What the gate and the operator rely on, on every backend."""

    def decide(
        self, flows: FlowHarness, partner: Flow, limit: int = 50
    ) -> tuple[Decided, dict[int, str]]:
        """Claim due rows and decide for them as the gate would; the decision and
        the claimed rows' tags by id."""
        token, messages = flows.claim(limit)
        decided = flows.flows.decide(partner, [candidate(m) for m in messages], token)
        return decided, {m.id: m.envelope.task_id.split("-")[0] for m in messages}

    def test_a_key_at_its_running_limit_waits_and_the_others_go(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        flows.enqueue(
            [of_key("a1", "a"), of_key("a2", "a"), of_key("a3", "a"), of_key("b1", "b")]
        )
        decided, by_id = self.decide(flows, partner)
        assert [by_id[i] for i in decided.free] == ["a1", "b1"]
        assert sorted(by_id[i] for i in decided.waiting) == ["a2", "a3"]
        # The waiting rows are out of every claim until a slot of their key frees.
        assert tags(flows.claim(50)[1]) == []
        assert flows.flows.task_ended(partner, "b", self.ids["b1"]) == 0
        assert tags(flows.claim(50)[1]) == []
        assert flows.flows.task_ended(partner, "a", self.ids["a1"]) == 1
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]
        # a1's slot is free: a2 takes it.
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (len(found.free), found.waiting) == (1, ())

    def test_a_slot_freed_wakes_a_row_of_its_flow_not_of_another_flow_of_the_key(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        mailer = Flow(
            "mailer", ("shop.send_mail",), (), parse_limits({"running": 1}), 300.0
        )
        # The partner's rows of key "a" are older: a wake by id alone takes them.
        flows.enqueue(
            [of_key("p1", "a"), of_key("p2", "a")]
            + [of_key(f"m{i}", "a", "shop.send_mail") for i in (1, 2)]
        )
        token, messages = flows.claim(50)
        for each in (partner, mailer):
            mine = [candidate(m) for m in messages if each.covers(m.envelope.task_name)]
            assert len(flows.flows.decide(each, mine, token).waiting) == 1
        assert flows.flows.task_ended(mailer, "a", self.ids["m1"]) == 1
        assert tags(flows.claim(50)[1]) == ["m2"]

    @pytest.fixture(autouse=True)
    def _ids(self, flows: FlowHarness) -> None:
        self.ids: dict[str, str] = {}
        enqueue = flows.enqueue

        def remembered(envelopes: Sequence[Envelope]) -> None:
            for built in envelopes:
                self.ids[built.task_id.split("-")[0]] = built.task_id
            enqueue(envelopes)

        flows.enqueue = remembered  # type: ignore[method-assign]

    def test_keys_that_differ_in_case_accent_space_or_emoji_are_distinct(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        keys = [key for pair in SPELLINGS for key in pair]
        flows.enqueue(
            [of_key(f"k{i}r{run}", key) for i, key in enumerate(keys) for run in (1, 2)]
        )
        decided, by_id = self.decide(flows, partner)
        assert sorted(by_id[i] for i in decided.free) == [f"k{i}r1" for i in range(8)]
        stats = flows.flows.flow_stats([partner])[0]
        # A slot and a waiting row per key, under the key as it was sent.
        assert sorted((k.key, k.running, k.waiting) for k in stats.keys) == sorted(
            (key, 1, 1) for key in keys
        )
        # The end of the second spelling's task wakes the second spelling's row.
        for i in range(1, 8, 2):
            assert flows.flows.task_ended(partner, keys[i], self.ids[f"k{i}r1"]) == 1
        assert tags(flows.claim(50)[1]) == [f"k{i}r2" for i in range(1, 8, 2)]

    def test_a_queued_limit_frees_its_slot_when_the_task_starts(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(queued=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a")])
        decided, by_id = self.decide(flows, partner)
        assert [by_id[i] for i in decided.free] == ["a1"]
        assert flows.flows.task_started(partner, "a", self.ids["a1"]) == 1
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert len(found.free) == 1
        stats = flows.flows.flow_stats([partner])[0]
        # a1 runs, a2 is published and not started.
        assert (stats.running, stats.queued) == (2, 1)

    def test_a_row_whose_publish_failed_does_not_wait_behind_its_own_slot(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        flows.enqueue([of_key("a1", "a")])
        token, first = flows.claim(50)
        assert (
            len(flows.flows.decide(partner, [candidate(m) for m in first], token).free)
            == 1
        )
        # The broker refused it: the relay puts it back; it comes again, slot and all.
        again = flows.flows.decide(partner, [candidate(m) for m in first], token)
        assert (len(again.free), again.waiting) == (1, ())
        assert flows.flows.flow_stats([partner])[0].running == 1

    def test_a_row_the_broker_did_not_take_frees_its_slot_and_wakes_its_key(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a"), of_key("b1", "b")])
        token, first = flows.claim(50)
        rows = [candidate(m) for m in first]
        decided = flows.flows.decide(partner, rows, token)
        assert len(decided.waiting) == 1
        refused = [c for c in rows if c.task_id in (self.ids["a1"], self.ids["b1"])]
        # a1's slot frees and wakes a2; b1's frees, with no row of b to wake.
        assert flows.flows.not_published(partner, refused) == 1
        assert tags(flows.claim(50)[1]) == ["a2"]
        assert flows.flows.flow_stats([partner])[0].running == 0
        # Nothing left to free: nothing woken twice.
        assert flows.flows.not_published(partner, refused) == 0

    def test_a_row_not_published_frees_its_unstarted_slot_not_its_runs(
        self, flows: FlowHarness
    ) -> None:
        # A retry's row (its run's task id) that the broker refused: the run
        # still holds its started slot until it reports its end.
        partner = keyed_flow(running=2)
        flows.enqueue([of_key("a1", "a")])
        self.decide(flows, partner)
        flows.flows.task_started(partner, "a", self.ids["a1"])
        flows.enqueue([self.retry_of("a1", "a")])
        token, again = flows.claim(50)
        flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert flows.flows.flow_stats([partner])[0].running == 2
        flows.flows.not_published(partner, [candidate(m) for m in again])
        stats = flows.flows.flow_stats([partner])[0]
        assert (stats.running, stats.queued) == (1, 0)

    def test_a_started_task_of_a_queued_limit_wakes_nothing_when_it_ends(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(queued=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a"), of_key("a3", "a")])
        decided, by_id = self.decide(flows, partner)
        assert [by_id[i] for i in decided.free] == ["a1"]
        assert flows.flows.task_started(partner, "a", self.ids["a1"]) == 1
        # a1 was no longer queued: its end frees no queued place, a3 keeps waiting.
        assert flows.flows.task_ended(partner, "a", self.ids["a1"]) == 0
        assert tags(flows.claim(50)[1]) == ["a2"]

    def test_a_key_of_its_own_limit_takes_it(self, flows: FlowHarness) -> None:
        partner = keyed_flow(running=1, keys={"vip-*": {"running": 2}})
        flows.enqueue(
            [of_key(f"v{i}", "vip-1") for i in range(3)]
            + [of_key(f"o{i}", "other") for i in range(3)]
        )
        decided, by_id = self.decide(flows, partner)
        assert sorted(by_id[i] for i in decided.free) == ["o0", "v0", "v1"]

    def test_the_keys_take_turns_for_the_rate(self, flows: FlowHarness) -> None:
        partner = keyed_flow(rates=("3/m",), running=10)
        flows.enqueue(
            [of_key(f"a{i}", "a") for i in range(4)]
            + [of_key("b0", "b"), of_key("c0", "c")]
        )
        decided, by_id = self.decide(flows, partner)
        assert decided.grant.granted == 3
        assert [by_id[i] for i in decided.free[:3]] == ["a0", "b0", "c0"]

    def test_a_slot_no_report_frees_frees_after_the_lease(
        self, flows: FlowHarness
    ) -> None:
        # Its queue no longer holds the task (a worker that cannot report took it,
        # or the broker lost it): past the lease the slot frees and wakes a2.
        partner = keyed_flow(lease=1.0, running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a")])
        decided, _ = self.decide(flows, partner)
        assert (len(decided.waiting), decided.overdue) == (1, ())
        flows.wait(1.1)
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        # Counted until the gate learns what the queue holds.
        assert (found.free, len(found.waiting), found.overdue) == ((), 1, ("celery",))
        assert flows.flows.outlived(partner, {"celery": 0}) == 1
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (len(found.free), found.waiting, found.overdue) == (1, (), ())

    def test_a_task_waiting_in_its_queue_past_the_lease_keeps_its_slot(
        self, flows: FlowHarness
    ) -> None:
        # The workers are slow: a1 waits in the queue longer than the lease. It is
        # still queued, and the key's next task waits for it, however long.
        partner = keyed_flow(lease=1.0, queued=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a")])
        self.decide(flows, partner)
        flows.wait(1.1)
        token, again = flows.claim(50)
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (found.free, found.overdue) == ((), ("celery",))
        assert flows.flows.outlived(partner, {"celery": 1}) == 0
        stats = flows.flows.flow_stats([partner])[0]
        assert (stats.running, stats.queued) == (1, 1)
        # Its lease counts again from now: the next decision finds nothing overdue.
        flows.wait(0.5)
        token, again = flows.claim(50)
        assert tags(again) == []  # a2 parked until then
        assert flows.flows.task_started(partner, "a", self.ids["a1"]) == 1
        token, again = flows.claim(50)
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (tags(again), len(found.free), found.overdue) == (["a2"], 1, ())

    def test_a_queue_that_holds_fewer_tasks_frees_the_oldest_slots(
        self, flows: FlowHarness
    ) -> None:
        # A queue hands out its oldest message first: with one message left in
        # it, a1 (published first) is the one that left unreported.
        partner = keyed_flow(lease=1.0, running=1)
        flows.enqueue([of_key("a1", "a"), of_key("b1", "b")])
        self.decide(flows, partner)
        flows.enqueue([of_key("a2", "a"), of_key("b2", "b")])
        flows.wait(1.1)
        token, again = flows.claim(50)
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (found.free, found.overdue) == ((), ("celery",))
        assert flows.flows.outlived(partner, {"celery": 1}) == 1
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]  # b1 still waits in the queue: b2 stays parked
        stats = flows.flows.flow_stats([partner])[0]
        assert [(k.key, k.running) for k in stats.keys] == [("b", 1)]

    def test_a_broker_that_cannot_count_leaves_the_lease_alone_to_free(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(lease=1.0, running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a")])
        self.decide(flows, partner)
        flows.wait(1.1)
        assert flows.flows.outlived(partner, None) == 1
        assert tags(flows.claim(50)[1]) == ["a2"]

    def test_a_row_waiting_for_a_started_slot_comes_back_when_its_lease_ends(
        self, flows: FlowHarness
    ) -> None:
        # The start renews the slot's lease; a row parked before it, back when the
        # lease counted from the publish ended, waits again until the renewed one
        # ends, not a whole lease more (a killed worker's key waited two leases).
        partner = keyed_flow(lease=1.0, running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a")])
        self.decide(flows, partner)
        flows.wait(0.5)
        flows.flows.task_started(partner, "a", self.ids["a1"])
        flows.wait(0.6)
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert len(found.waiting) == 1
        flows.wait(0.7)
        token, again = flows.claim(50)
        assert tags(again) == ["a2"]
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (len(found.free), found.waiting) == (1, ())

    def retry_of(self, tag: str, key: str) -> Envelope:
        """The row ``self.retry()`` writes for the task ``tag``: its task id again."""
        return envelope(
            tag,
            task_id=self.ids[tag],
            task_name="shop.call_partner",
            headers={"task": "shop.call_partner", KEY_HEADER: key},
        )

    def test_a_retry_waits_for_its_run_to_report_its_end_under_a_running_limit(
        self, flows: FlowHarness
    ) -> None:
        # self.retry() writes the retry's row before the run's end is reported: the
        # run still holds the key's place until then.
        partner = keyed_flow(running=1)
        flows.enqueue([of_key("a1", "a"), of_key("b1", "a")])
        self.decide(flows, partner)
        flows.flows.task_started(partner, "a", self.ids["a1"])
        flows.enqueue([self.retry_of("a1", "a")])
        decided, _ = self.decide(flows, partner)
        assert (decided.free, len(decided.waiting)) == ((), 1)
        flows.flows.task_ended(partner, "a", self.ids["a1"])
        token, again = flows.claim(50)
        assert tags(again) == ["b1"]  # the oldest waiting row takes the place
        flows.flows.decide(partner, [candidate(m) for m in again], token)
        # b1 runs; the retry waits for the next place.
        stats = flows.flows.flow_stats([partner])[0]
        assert [(k.key, k.running, k.waiting) for k in stats.keys] == [("a", 1, 1)]

    def test_a_runs_end_frees_its_own_slot_not_its_retrys(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(queued=1)
        flows.enqueue([of_key("a1", "a")])
        self.decide(flows, partner)
        flows.flows.task_started(partner, "a", self.ids["a1"])
        flows.enqueue([self.retry_of("a1", "a")])
        decided, _ = self.decide(flows, partner)
        assert len(decided.free) == 1  # a started run is not queued
        flows.flows.task_ended(partner, "a", self.ids["a1"])  # the run's end, late
        stats = flows.flows.flow_stats([partner])[0]
        assert (stats.running, stats.queued) == (1, 1)  # the retry, not started

    def test_a_requeued_task_keeps_its_slot_queued_until_its_next_run_ends(
        self, flows: FlowHarness
    ) -> None:
        # Reject(requeue=True): the task is back in the broker and runs again. Its
        # slot freed, a2 would run beside it: two under running 1.
        partner = keyed_flow(running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a")])
        self.decide(flows, partner)
        flows.flows.task_started(partner, "a", self.ids["a1"])
        assert flows.flows.task_requeued(partner, "a", self.ids["a1"]) == 0
        assert tags(flows.claim(50)[1]) == []  # a2 still waits
        stats = flows.flows.flow_stats([partner])[0]
        assert (stats.running, stats.queued) == (1, 1)  # published, not started
        assert flows.flows.task_started(partner, "a", self.ids["a1"]) == 0
        stats = flows.flows.flow_stats([partner])[0]
        assert (stats.running, stats.queued) == (1, 0)
        assert flows.flows.task_ended(partner, "a", self.ids["a1"]) == 1
        assert tags(flows.claim(50)[1]) == ["a2"]

    def test_a_requeued_task_whose_lease_passed_counts_again(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1, lease=0.2)
        flows.enqueue([of_key("a1", "a")])
        self.decide(flows, partner)
        flows.wait(0.5)
        flows.flows.task_requeued(partner, "a", self.ids["a1"])
        stats = flows.flows.flow_stats([partner])[0]
        assert (stats.running, stats.queued) == (1, 1)

    def test_an_operator_raises_a_limit_and_the_waiting_rows_come_back(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a"), of_key("a3", "a")])
        self.decide(flows, partner)
        flows.flows.set_limits("partner", Limits(KeyLimit(running=3)))
        token, again = flows.claim(50)
        assert tags(again) == ["a2", "a3"]
        found = flows.flows.decide(partner, [candidate(m) for m in again], token)
        assert (len(found.free), found.waiting) == (2, ())
        stats = flows.flows.flow_stats([partner])[0]
        assert stats.limits_changed and stats.limits.every.running == 3
        assert [(k.key, k.running, k.waiting) for k in stats.keys] == [("a", 3, 0)]

    def test_the_stats_show_each_keys_running_and_waiting_rows(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a"), of_key("b1", "b")])
        self.decide(flows, partner)
        stats = flows.flows.flow_stats([partner])[0].as_dict()
        assert (stats["running"], stats["queued"], stats["waiting"]) == (2, 2, 3)
        assert stats["keys"] == [
            {
                "key": "a",
                "running": 1,
                "queued": 1,
                "waiting": 1,
                "limit": {"running": 1},
            },
            {
                "key": "b",
                "running": 1,
                "queued": 1,
                "waiting": 0,
                "limit": {"running": 1},
            },
        ]

    def test_it_grants_up_to_the_rate_and_says_when_the_window_frees(
        self, flows: FlowHarness
    ) -> None:
        partner = flow("partner", "5/s")
        assert flows.flows.reserve(partner, 3).granted == 3
        late = flows.flows.reserve(partner, 4)
        assert late.granted == 2
        # The first record leaves the one-second window within a second.
        assert 0.0 < late.wait <= 1.0
        assert late.pace == pytest.approx(0.2)
        assert [str(r) for r in late.rates] == ["5/s"]
        assert flows.flows.reserve(partner, 1).granted == 0

    def test_a_window_takes_more_once_its_records_have_left_it(
        self, flows: FlowHarness
    ) -> None:
        partner = flow("partner", "5/s")
        assert flows.flows.reserve(partner, 5).granted == 5
        assert flows.flows.reserve(partner, 5).granted == 0
        flows.wait(1.05)
        assert flows.flows.reserve(partner, 9).granted == 5

    def test_every_rate_of_a_flow_holds(self, flows: FlowHarness) -> None:
        partner = flow("partner", "5/s", "7/m")
        assert flows.flows.reserve(partner, 9).granted == 5
        flows.wait(1.05)
        # The second window has room again; the minute's has 2 left.
        found = flows.flows.reserve(partner, 9)
        assert found.granted == 2
        assert found.pace == pytest.approx(60 / 7)
        assert 58.0 < found.wait <= 60.0

    def test_rows_held_in_a_later_batch_wait_behind_those_held_before(
        self, flows: FlowHarness
    ) -> None:
        partner = flow("partner", "5/s")
        first = flows.flows.reserve(partner, 10)
        # 5 held: slots from 1 s from now, one every 0.2 s, up to 2 s from now.
        assert (first.granted, first.held) == (5, 5)
        assert 1.5 < first.paced_for <= 2.0
        later = flows.flows.reserve(partner, 3)
        assert (later.granted, later.held) == (0, 3)
        assert 1.5 < later.wait <= 2.0
        assert later.paced_for == pytest.approx(later.wait + 0.6)

    def test_flows_do_not_share_a_window(self, flows: FlowHarness) -> None:
        assert flows.flows.reserve(flow("partner", "2/s"), 5).granted == 2
        assert flows.flows.reserve(flow("mailer", "3/s"), 5).granted == 3

    def test_flows_whose_names_differ_in_case_accent_or_space_do_not_share_a_window(
        self, flows: FlowHarness
    ) -> None:
        names = [name for pair in SPELLINGS[:3] for name in pair]
        every = [flow(name, "1/m") for name in names]
        assert [flows.flows.reserve(each, 1).granted for each in every] == [1] * 6
        stats = flows.flows.flow_stats(every)
        assert [(s.name, s.published_last_minute) for s in stats] == [
            (name, 1) for name in names
        ]

    def test_an_operator_changes_the_rates_at_the_next_decision(
        self, flows: FlowHarness
    ) -> None:
        partner = flow("partner", "2/s")
        flows.flows.set_rates("partner", (parse_rate("4/s"),))
        assert flows.flows.reserve(partner, 9).granted == 4
        flows.flows.set_rates("partner", None)
        flows.wait(1.05)
        found = flows.flows.reserve(partner, 9)
        assert (found.granted, [str(r) for r in found.rates]) == (2, ["2/s"])

    def test_the_stats_show_waiting_rows_recent_publishes_and_the_rates(
        self, flows: FlowHarness
    ) -> None:
        partner = flow("partner", "5/s", "100000/d")
        mailer = flow("mailer", "1/m", tasks=("mail.*",))
        flows.enqueue(
            [
                envelope("a", task_name="shop.call_partner"),
                envelope("b", task_name="shop.sync_stock"),
                envelope("c", task_name="shop.record"),
                envelope("d", task_name="mail.send"),
            ]
        )
        flows.flows.reserve(partner, 3)
        flows.flows.set_rates("mailer", (parse_rate("2/m"),))
        stats = {s.name: s.as_dict() for s in flows.flows.flow_stats([partner, mailer])}
        assert stats == {
            "partner": {
                "name": "partner",
                "tasks": ["shop.call_partner", "shop.sync_*"],
                "rates": ["5/s", "100000/d"],
                "changed": False,
                "limits": {},
                "limits_changed": False,
                "waiting": 2,
                "published_last_minute": 3,
                "running": 0,
                "queued": 0,
                "keys": [],
                "parked": 0,
                "configured": True,
            },
            "mailer": {
                "name": "mailer",
                "tasks": ["mail.*"],
                "rates": ["2/m"],
                "changed": True,
                "limits": {},
                "limits_changed": False,
                "waiting": 1,
                "published_last_minute": 0,
                "running": 0,
                "queued": 0,
                "keys": [],
                "parked": 0,
                "configured": True,
            },
        }

    def test_relays_deciding_at_once_never_grant_more_than_the_rate(
        self, flows: FlowHarness
    ) -> None:
        partner = flow("partner", "50/m")
        flows.flows.reserve(partner, 1)  # the flow's row exists: no race to make it
        granted: list[int] = []
        errors: list[BaseException] = []

        def relay() -> None:
            store = flows.store_for_thread()
            try:
                for _ in range(4):
                    granted.append(store.reserve(partner, 4).granted)
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)
            finally:
                store.reset_connection()

        threads = [threading.Thread(target=relay) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        # 64 wanted, 49 left in the window: every one of them, and not one more.
        assert sum(granted) == 49

    # -- a setting's state, reconciled with the settings ---------------------------

    def park_two(self, flows: FlowHarness, partner: Flow) -> None:
        """Three rows of key 'a' under running 1: one goes, two are parked."""
        flows.enqueue([of_key("a1", "a"), of_key("a2", "a"), of_key("a3", "a")])
        decided, _ = self.decide(flows, partner)
        assert (len(decided.free), len(decided.waiting)) == (1, 2)

    def test_a_flow_removed_from_the_settings_has_its_parked_rows_released_once(
        self, flows: FlowHarness
    ) -> None:
        self.park_two(flows, keyed_flow(running=1))
        stats = flows.flows.flow_stats([])
        assert [(s.name, s.configured, s.parked) for s in stats] == [
            ("partner", False, 2)
        ]
        assert flows.flows.reconcile([]) == {"partner": 2}
        assert flows.flows.reconcile([]) == {}  # each row once
        assert tags(flows.claim(50)[1]) == ["a2", "a3"]
        assert flows.flows.flow_stats([]) == ()

    @pytest.mark.parametrize(
        "now",
        [
            Flow("renamed", ("shop.call_partner",), (), parse_limits({"running": 1})),
            Flow("partner", ("shop.call_partner",), (parse_rate("5/s"),)),
            Flow("partner", ("shop.other",), (), parse_limits({"running": 1})),
        ],
        ids=["renamed", "lost-its-limits", "no-longer-covers-the-task"],
    )
    def test_a_flow_that_no_longer_holds_its_parked_rows_releases_them(
        self, flows: FlowHarness, now: Flow
    ) -> None:
        self.park_two(flows, keyed_flow(running=1))
        assert flows.flows.reconcile([now]) == {"partner": 2}
        assert tags(flows.claim(50)[1]) == ["a2", "a3"]

    def test_rows_a_flow_still_holds_stay_parked_at_a_relays_start(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        self.park_two(flows, partner)
        assert flows.flows.reconcile([partner]) == {}
        assert tags(flows.claim(50)[1]) == []
        assert flows.flows.flow_stats([partner])[0].parked == 2

    def test_limits_changed_on_one_flow_wake_its_parked_rows_and_no_others(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=1)
        mailer = Flow(
            "mailer", ("shop.send_mail",), (), parse_limits({"running": 1}), 300.0
        )
        flows.enqueue(
            [of_key(f"p{i}", "a") for i in (1, 2)]
            + [of_key(f"m{i}", "a", "shop.send_mail") for i in (1, 2)]
        )
        token, messages = flows.claim(50)
        for each in (partner, mailer):
            mine = [candidate(m) for m in messages if each.covers(m.envelope.task_name)]
            assert len(flows.flows.decide(each, mine, token).waiting) == 1
        flows.flows.set_limits("mailer", Limits(KeyLimit(running=2)))
        assert tags(flows.claim(50)[1]) == ["m2"]

    def test_a_key_an_operator_adds_is_the_first_its_keys_match(
        self, flows: FlowHarness
    ) -> None:
        partner = keyed_flow(running=2, keys={"premium-*": {"running": 5}})
        flows.flows.set_limits(
            "partner", partner.limits.put("premium-7", KeyLimit(running=1))
        )
        flows.enqueue([of_key(f"p{i}", "premium-7") for i in range(4)])
        decided, _ = self.decide(flows, partner)
        assert (len(decided.free), len(decided.waiting)) == (1, 3)
        stats = flows.flows.flow_stats([partner])[0]
        assert [p for p, _ in stats.limits.keys] == ["premium-7", "premium-*"]
