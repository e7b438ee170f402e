"""The store by role: the factory resolves the alias and history once, and each object
it builds holds its role only."""

from __future__ import annotations

import pytest
from django.test import override_settings

from celery_outbox.store import Stores, outbox_stores
from celery_outbox.store.store import OutboxWriter

#: Each role's own methods, by the factory's name for it. Every role object also has
#: ``alias`` and ``reset_connection``; each that writes or reads history has
#: ``check_history``.
ROLES = {
    "relay": {"claim", "settle", "renew", "relay_lock", "ping"},
    "writer": {"insert"},
    "dedup": {"hold_keys", "purge_dedup_keys"},
    "operator": {"stats", "summary", "replay_dead_letters", "purge_dead_letters"},
    "ordering": {"task_done", "blocked_heads", "retry_head", "skip_head"},
    "history_log": {"trace", "purge_history"},
    "registry": {"beat", "take_over", "leave"},
    "events": {"insert_later", "insert_dead", "dead_events"},
}


def test_the_factory_resolves_the_outbox_alias_and_history_once() -> None:
    with override_settings(CELERY_OUTBOX_DATABASE="mysql", CELERY_OUTBOX_HISTORY=True):
        stores = outbox_stores(holder="relay-7")
    # Built after the settings changed back: the factory's reading holds.
    relay, operator = stores.relay(), stores.operator()
    assert (relay.alias, relay.holder, relay.history) == ("mysql", "relay-7", True)
    assert (operator.alias, operator.holder, operator.history) == ("mysql", None, True)
    assert stores.registry().holder == "relay-7"
    assert Stores("sqlite", history=False).history_log().history is False


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_object_holds_its_own_methods_and_no_others(role: str) -> None:
    built = getattr(Stores("default", history=False), role)()
    assert built.alias == "default"
    others = set().union(*(ROLES[r] for r in ROLES if r != role))
    assert {name for name in ROLES[role] if hasattr(built, name)} == ROLES[role]
    assert {name for name in others if hasattr(built, name)} == set()


def test_the_enqueue_writer_resolves_no_setting() -> None:
    # The enqueue path builds one per call: it must cost no settings lookup.
    assert not hasattr(OutboxWriter("default"), "history")
