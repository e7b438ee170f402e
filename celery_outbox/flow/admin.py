"""Flows in the Django admin: each flow's rates and limits per key in force, and
changing them.

The list shows the flows that have a row (every flow a relay decided for, or whose
rates an operator changed). The editable fields are the operator's rates and
limits, saved through the flow store as ``outbox flows rate`` and ``outbox flows
limit`` save them: every relay takes them at its next decision; an empty field goes
back to the settings'.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from ..conf import get_settings
from ..flow_limits import (
    Limits,
    changeable,
    limits_in_force,
    parse_rates,
    rates_text,
    read_limits,
)
from ..models import FlowState
from ..store import outbox_stores


class FlowRatesForm(forms.ModelForm):  # type: ignore[type-arg]
    """The operator's rates, checked as the setting's are."""

    class Meta:
        model = FlowState
        fields = ("rates", "limits")
        help_texts = {
            "rates": "e.g. '20/s, 100000/d' (units s, m, h, d); empty: the rates "
            "of CELERY_OUTBOX_FLOWS",
            "limits": "limits per flow key, as the setting writes them, e.g. "
            '{"running": 2, "keys": {"premium-*": {"running": 10}}}; empty: the '
            "limits of CELERY_OUTBOX_FLOWS",
        }

    def clean_limits(self) -> str | None:
        """The limits as stored (JSON), or None for the settings' limits: checked as
        ``outbox flows limit`` checks them (:func:`read_limits`, on a flow with
        limits per key in the settings), so that what is saved is what relays apply."""
        text = str(self.cleaned_data.get("limits") or "").strip()
        if not text:
            return None
        name = self.instance.name
        try:
            changeable(
                next((f for f in get_settings().flows if f.name == name), None), name
            )
            return read_limits(json.loads(text)).text()
        except ValueError as exc:
            raise forms.ValidationError(f"{exc}.") from None

    def clean_rates(self) -> str | None:
        """The rates as stored, or None for the settings' rates."""
        text = str(self.cleaned_data.get("rates") or "").strip()
        if not text:
            return None
        try:
            rates = parse_rates([part.strip() for part in text.split(",")])
        except ValueError as exc:
            raise forms.ValidationError(f"{exc}.") from None
        return rates_text(rates)


@admin.register(FlowState)
class FlowStateAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Flows: their rates in force; an operator's rates, changed in place."""

    form = FlowRatesForm
    list_display = ("name", "in_force", "limits_in_force", "changed_at")
    fields = (
        "name",
        "configured",
        "rates",
        "configured_limits",
        "limits",
        "changed_at",
    )
    readonly_fields = ("name", "configured", "configured_limits", "changed_at")
    ordering = ("name",)

    @admin.display(description="rates in force")
    def in_force(self, obj: FlowState) -> str:
        """The operator's rates, else the settings'."""
        return obj.rates or self.configured(obj)

    @admin.display(description="rates of the settings")
    def configured(self, obj: FlowState) -> str:
        """The rates ``CELERY_OUTBOX_FLOWS`` gives the flow ("-": none any more)."""
        found = next((f for f in get_settings().flows if f.name == obj.name), None)
        return "-" if found is None else rates_text(found.rates)

    @admin.display(description="limits per key in force")
    def limits_in_force(self, obj: FlowState) -> str:
        """The operator's limits, else the settings'."""
        found = next((f for f in get_settings().flows if f.name == obj.name), None)
        if found is None or not found.limits:
            return "-"  # no relay decides per key for it
        return str(limits_in_force(found, obj.limits))

    @admin.display(description="limits per key of the settings")
    def configured_limits(self, obj: FlowState) -> str:
        """The limits ``CELERY_OUTBOX_FLOWS`` gives the flow's keys ("-": none)."""
        found = next((f for f in get_settings().flows if f.name == obj.name), None)
        return "-" if found is None or not found.limits else str(found.limits)

    def save_model(
        self, request: HttpRequest, obj: FlowState, form: Any, change: bool
    ) -> None:
        """Through the flow store, as ``outbox flows rate`` and ``limit`` do."""
        store = outbox_stores().flows()
        text = form.cleaned_data.get("rates")
        rates = parse_rates([p.strip() for p in text.split(",")]) if text else None
        store.set_rates(obj.name, rates)
        if "limits" in form.changed_data:
            stored = form.cleaned_data.get("limits")
            limits: Limits | None = read_limits(json.loads(stored)) if stored else None
            store.set_limits(obj.name, limits)

    def has_add_permission(self, request: HttpRequest) -> bool:
        """A flow's row comes from the settings, not from the admin."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """The relays keep the row: deleting it would only make them write it again."""
        return False
