"""``outbox flows stats``, ``outbox flows rate`` and ``outbox flows limit`` on every
database: what an operator reads and changes, and what the next decision of a relay
then does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.test import override_settings

from celery_outbox.cli.exits import ExitStatus
from celery_outbox.conf import get_settings
from celery_outbox.flow.gate import candidate
from celery_outbox.flow_limits import KEY_HEADER
from celery_outbox.store import Stores

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

FLOWS = {
    "partner": {
        "tasks": ["shop.call_partner", "shop.sync_*"],
        "rate": ["3/s", "1000/d"],
    },
    "tenants": {"tasks": ["shop.per_tenant"], "running": 1},
}


@pytest.fixture
def on_alias(alias: str) -> Iterator[str]:
    with override_settings(CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_FLOWS=FLOWS):
        yield alias


def outbox(*args: str) -> str:
    out = StringIO()
    call_command("outbox", *args, stdout=out)
    return out.getvalue()


def test_stats_show_each_flows_backlog_recent_publishes_and_rate(
    on_alias: str,
) -> None:
    with transaction.atomic(using=on_alias):
        Stores(on_alias).writer().insert(
            [envelope(str(i), task_name="shop.sync_stock") for i in range(4)]
        )
    partner = get_settings().flows[0]
    assert Stores(on_alias).flows().reserve(partner, 5).granted == 3
    assert json.loads(outbox("flows", "stats", "--format", "json"))[:1] == [
        {
            "name": "partner",
            "tasks": ["shop.call_partner", "shop.sync_*"],
            "rates": ["3/s", "1000/d"],
            "changed": False,
            "limits": {},
            "limits_changed": False,
            "waiting": 4,
            "published_last_minute": 3,
            "running": 0,
            "queued": 0,
            "keys": [],
            "parked": 0,
            "configured": True,
        }
    ]
    assert outbox("flows", "stats").splitlines()[:1] == [
        "partner: waiting 4  published in the last minute 3  rate 3/s, 1000/d "
        "(settings)"
    ]


def test_a_rate_changed_by_command_is_the_next_decisions_and_reset_undoes_it(
    on_alias: str,
) -> None:
    partner = get_settings().flows[0]
    assert outbox("flows", "rate", "partner", "5/s", "10/m") == (
        "flow 'partner': rate 5/s, 10/m on every relay from now\n"
    )
    found = Stores(on_alias).flows().reserve(partner, 9)
    assert (found.granted, [str(r) for r in found.rates]) == (5, ["5/s", "10/m"])
    assert json.loads(outbox("flows", "stats", "--format", "json"))[0]["changed"]
    assert outbox("flows", "rate", "partner", "--reset") == (
        "flow 'partner': back to the settings' rate 3/s, 1000/d\n"
    )
    stats = json.loads(outbox("flows", "stats", "--format", "json"))[0]
    assert (stats["rates"], stats["changed"]) == (["3/s", "1000/d"], False)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("mailer", "5/s"),
            "No flow 'mailer' in CELERY_OUTBOX_FLOWS (configured: partner, tenants)",
        ),
        (("partner", "20/x"), "'20/x' is not a rate"),
        (("partner", "0/s"), "'0/s' lets nothing through"),
        (("partner",), "Give the new rates"),
        (("partner", "5/s", "--reset"), "not both"),
    ],
)
def test_a_wrong_rate_command_changes_nothing_and_says_why(
    on_alias: str, args: tuple[str, ...], said: str
) -> None:
    with pytest.raises(CommandError, match=None) as raised:
        outbox("flows", "rate", *args)
    assert said in str(raised.value)
    assert (
        json.loads(outbox("flows", "stats", "--format", "json"))[0]["changed"] is False
    )


def test_a_limit_changed_by_command_is_the_next_decisions_and_reset_undoes_it(
    on_alias: str,
) -> None:
    tenants = get_settings().flows[1]
    with transaction.atomic(using=on_alias):
        Stores(on_alias).writer().insert(
            [
                envelope(
                    f"t{i}", task_name="shop.per_tenant", headers={KEY_HEADER: "t"}
                )
                for i in range(4)
            ]
        )
    claim = Stores(on_alias).relay().claim(10, 30.0)
    flows = Stores(on_alias).flows()
    first = flows.decide(tenants, [candidate(m) for m in claim.messages], claim.token)
    assert (len(first.free), len(first.waiting)) == (1, 3)
    assert outbox("flows", "stats").splitlines()[1:] == [
        "tenants: waiting 4  published in the last minute 1  no rate",
        "  per key: running 1 (settings)  running 1  queued 1  parked 3",
        "  key 't': running 1  queued 1  waiting 3  limit running 1",
    ]
    assert outbox("flows", "limit", "tenants", "--key", "t*", "--running", "3") == (
        "flow 'tenants': limits running 1; t*: running 3 (on every relay from now)\n"
    )
    # The parked rows were woken: the next decision takes the new limit.
    claim = Stores(on_alias).relay().claim(10, 30.0)
    again = flows.decide(tenants, [candidate(m) for m in claim.messages], claim.token)
    assert (len(again.free), len(again.waiting)) == (2, 1)
    stats = json.loads(outbox("flows", "stats", "--format", "json"))[1]
    assert stats["limits"] == {"running": 1, "keys": {"t*": {"running": 3}}}
    assert stats["limits_changed"] is True
    assert outbox("flows", "limit", "tenants", "--reset") == (
        "flow 'tenants': limits running 1 (the settings')\n"
    )
    stats = json.loads(outbox("flows", "stats", "--format", "json"))[1]
    assert (stats["limits"], stats["limits_changed"]) == ({"running": 1}, False)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("mailer", "--running", "2"), "No flow 'mailer' in CELERY_OUTBOX_FLOWS"),
        (("partner", "--running", "2"), "has no limits per key in CELERY_OUTBOX_FLOWS"),
        (("tenants", "--running", "0"), "'running' is a whole number of at least 1"),
        (("tenants",), "Give the new limits"),
        (("tenants", "--queued", "2", "--reset"), "not both"),
    ],
)
def test_a_wrong_limit_command_changes_nothing_and_says_why(
    on_alias: str, args: tuple[str, ...], said: str
) -> None:
    with pytest.raises(CommandError) as raised:
        outbox("flows", "limit", *args)
    assert said in str(raised.value)
    stats = json.loads(outbox("flows", "stats", "--format", "json"))[1]
    assert (stats["limits"], stats["limits_changed"]) == ({"running": 1}, False)


def test_an_empty_key_is_refused_as_a_usage_error_and_nothing_is_lost(
    on_alias: str,
) -> None:
    outbox("flows", "limit", "tenants", "--running", "2")
    with pytest.raises(CommandError) as raised:
        outbox("flows", "limit", "tenants", "--key", "", "--running", "3")
    assert raised.value.returncode == ExitStatus.USAGE
    assert "--key" in str(raised.value) and "--key 'premium-*'" in str(raised.value)
    stats = json.loads(outbox("flows", "stats", "--format", "json"))[1]
    assert (stats["limits"], stats["limits_changed"]) == ({"running": 2}, True)


def test_a_reset_of_a_key_never_set_says_nothing_changed_and_fails(
    on_alias: str,
) -> None:
    outbox("flows", "limit", "tenants", "--key", "vip-*", "--running", "3")
    with pytest.raises(CommandError) as raised:
        outbox("flows", "limit", "tenants", "--key", "never-set", "--reset")
    assert raised.value.returncode == ExitStatus.FAILED
    assert "'never-set' has no limits of its own" in str(raised.value)
    assert "nothing changed" in str(raised.value)
    stats = json.loads(outbox("flows", "stats", "--format", "json"))[1]
    assert stats["limits"] == {"running": 1, "keys": {"vip-*": {"running": 3}}}


def test_a_key_set_by_command_runs_at_the_limit_the_command_printed(
    on_alias: str,
) -> None:
    premium = {
        "tenants": {
            "tasks": ["shop.per_tenant"],
            "running": 2,
            "keys": {"premium-gold-*": {"running": 6}, "premium-*": {"running": 5}},
        }
    }
    with override_settings(CELERY_OUTBOX_FLOWS=premium):
        said = outbox(
            "flows", "limit", "tenants", "--key", "premium-7", "--running", "1"
        )
        assert "premium-7: running 1; premium-gold-*" in said
        outbox("flows", "limit", "tenants", "--running", "3")
        (tenants,) = get_settings().flows
        with transaction.atomic(using=on_alias):
            Stores(on_alias).writer().insert(
                [
                    envelope(
                        f"{key}-{i}",
                        task_name="shop.per_tenant",
                        headers={KEY_HEADER: key},
                    )
                    for key in ("premium-7", "premium-gold-1")
                    for i in range(7)
                ]
            )
        claim = Stores(on_alias).relay().claim(50, 30.0)
        decided = (
            Stores(on_alias)
            .flows()
            .decide(tenants, [candidate(m) for m in claim.messages], claim.token)
        )
        by_id = {m.id: m.envelope.headers[KEY_HEADER] for m in claim.messages}
        free = [by_id[i] for i in decided.free]
        # premium-7 at the 1 printed; the every-key change left gold's 6 alone.
        assert (free.count("premium-7"), free.count("premium-gold-1")) == (1, 6)


def test_rows_parked_by_a_flow_since_removed_are_counted_and_released(
    on_alias: str,
) -> None:
    tenants = get_settings().flows[1]
    with transaction.atomic(using=on_alias):
        Stores(on_alias).writer().insert(
            [
                envelope(
                    f"t{i}", task_name="shop.per_tenant", headers={KEY_HEADER: "t"}
                )
                for i in range(3)
            ]
        )
    claim = Stores(on_alias).relay().claim(10, 30.0)
    Stores(on_alias).flows().decide(
        tenants, [candidate(m) for m in claim.messages], claim.token
    )
    renamed = {"partner": FLOWS["partner"], "tenants-v2": FLOWS["tenants"]}
    with override_settings(CELERY_OUTBOX_FLOWS=renamed):
        stats = json.loads(outbox("flows", "stats", "--format", "json"))
        assert [(s["name"], s["configured"], s["parked"]) for s in stats[2:]] == [
            ("tenants", False, 2)
        ]
        assert "tenants: not in CELERY_OUTBOX_FLOWS  parked 2" in outbox(
            "flows", "stats"
        )
        assert "parked    2 (tenants 2)" in outbox("tasks", "stats")
        said = outbox("flows", "limit", "tenants-v2", "--running", "2")
        assert "flow 'tenants': 2 row(s) it held released" in said
        assert len(Stores(on_alias).relay().claim(10, 30.0).messages) == 2
