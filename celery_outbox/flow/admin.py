"""Flows in the Django admin: each flow's rates in force, and changing them.

The list shows the flows that have a row (every flow a relay decided for, or whose
rates an operator changed). The one editable field is the operator's rates, saved
through the flow store as ``outbox flows rate`` saves them: every relay takes them
at its next decision; an empty field goes back to the settings' rates.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from ..conf import get_settings
from ..models import FlowState
from ..store import outbox_stores
from .core import parse_rates, rates_text


class FlowRatesForm(forms.ModelForm):  # type: ignore[type-arg]
    """The operator's rates, checked as the setting's are."""

    class Meta:
        model = FlowState
        fields = ("rates",)
        help_texts = {
            "rates": "e.g. '20/s, 100000/d' (units s, m, h, d); empty: the rates "
            "of CELERY_OUTBOX_FLOWS"
        }

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
    list_display = ("name", "in_force", "changed_at")
    fields = ("name", "configured", "rates", "changed_at")
    readonly_fields = ("name", "configured", "changed_at")
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

    def save_model(
        self, request: HttpRequest, obj: FlowState, form: Any, change: bool
    ) -> None:
        """Through the flow store, as ``outbox flows rate`` does."""
        text = form.cleaned_data.get("rates")
        rates = parse_rates([p.strip() for p in text.split(",")]) if text else None
        outbox_stores().flows().set_rates(obj.name, rates)

    def has_add_permission(self, request: HttpRequest) -> bool:
        """A flow's row comes from the settings, not from the admin."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """The relays keep the row: deleting it would only make them write it again."""
        return False
