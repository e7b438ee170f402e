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

from celery_outbox.envelope import Envelope
from celery_outbox.flow.core import Flow, parse_rate
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


def flow(name: str = "partner", *rates: str, tasks: tuple[str, ...] = ()) -> Flow:
    return Flow(
        name,
        tasks or ("shop.call_partner", "shop.sync_*"),
        tuple(parse_rate(r) for r in rates or ("5/s",)),
    )


class FlowContract:
    """What the gate and the operator rely on, on every backend."""

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
                "waiting": 2,
                "published_last_minute": 3,
            },
            "mailer": {
                "name": "mailer",
                "tasks": ["mail.*"],
                "rates": ["2/m"],
                "changed": True,
                "waiting": 1,
                "published_last_minute": 0,
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
