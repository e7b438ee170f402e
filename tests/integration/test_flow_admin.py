"""Flows in the admin: the rates and limits in force, and an operator's saved as the
``outbox flows rate`` and ``limit`` commands save them (the next decision of every
relay)."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

from celery_outbox.conf import get_settings
from celery_outbox.store import Stores

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

FLOWS = "/admin/celery_outbox/flowstate/"
PARTNER = {"partner": {"tasks": ["shop.call_partner"], "rate": ["3/s", "1000/d"]}}
TENANTS = {"tenants": {"tasks": ["shop.per_tenant"], "running": 1}}


@override_settings(CELERY_OUTBOX_FLOWS=PARTNER)
def test_an_operator_changes_a_flows_rates_in_the_admin(admin_client: Client) -> None:
    (partner,) = get_settings().flows
    flows = Stores("default").flows()
    flows.reserve(partner, 1)  # a relay decided for it: its row exists
    listing = admin_client.get(FLOWS).content.decode()
    assert "partner" in listing and "3/s, 1000/d" in listing
    page = f"{FLOWS}partner/change/"
    refused = admin_client.post(page, {"rates": "20/x"})
    assert refused.status_code == 200
    assert "&#x27;20/x&#x27; is not a rate" in refused.content.decode()
    assert flows.flow_stats([partner])[0].changed is False
    assert admin_client.post(page, {"rates": "5/s, 100/m"}).status_code == 302
    (stats,) = flows.flow_stats([partner])
    assert ([str(r) for r in stats.rates], stats.changed) == (["5/s", "100/m"], True)
    assert "5/s, 100/m" in admin_client.get(FLOWS).content.decode()
    admin_client.post(page, {"rates": ""})
    assert flows.flow_stats([partner])[0].changed is False


@override_settings(CELERY_OUTBOX_FLOWS=TENANTS)
def test_an_operator_changes_a_flows_limits_per_key_in_the_admin(
    admin_client: Client,
) -> None:
    (tenants,) = get_settings().flows
    flows = Stores("default").flows()
    flows.reserve(tenants, 1)
    assert "running 1" in admin_client.get(FLOWS).content.decode()
    page = f"{FLOWS}tenants/change/"
    refused = admin_client.post(page, {"rates": "", "limits": '{"running": 0}'})
    assert refused.status_code == 200
    assert "is a whole number of at least 1" in refused.content.decode()
    assert flows.flow_stats([tenants])[0].limits_changed is False
    wanted = '{"running": 1, "keys": {"vip-*": {"running": 4}}}'
    saved = admin_client.post(page, {"rates": "", "limits": wanted})
    assert saved.status_code == 302
    (stats,) = flows.flow_stats([tenants])
    assert stats.limits_changed and stats.limits.of("vip-7").running == 4
    assert "vip-*: running 4" in admin_client.get(FLOWS).content.decode()
    admin_client.post(page, {"rates": "", "limits": ""})
    assert flows.flow_stats([tenants])[0].limits_changed is False


def test_flows_are_neither_added_nor_deleted_in_the_admin(
    admin_client: Client,
) -> None:
    assert admin_client.get(f"{FLOWS}add/").status_code == 403


@override_settings(CELERY_OUTBOX_FLOWS={**PARTNER, **TENANTS})
@pytest.mark.parametrize(
    ("flow", "limits", "said"),
    [
        ("tenants", '{"runing": 3}', "unknown: [&#x27;runing&#x27;]"),
        ("tenants", "{}", "sets no limit"),
        ("partner", '{"running": 1}', "has no limits per key in CELERY_OUTBOX_FLOWS"),
    ],
)
def test_limits_no_relay_would_apply_are_refused_with_the_fix(
    admin_client: Client, flow: str, limits: str, said: str
) -> None:
    flows = Stores("default").flows()
    configured = {f.name: f for f in get_settings().flows}
    flows.reserve(configured[flow], 1)
    refused = admin_client.post(
        f"{FLOWS}{flow}/change/", {"rates": "", "limits": limits}
    )
    assert refused.status_code == 200
    assert said in refused.content.decode()
    assert flows.flow_stats([configured[flow]])[0].limits_changed is False
