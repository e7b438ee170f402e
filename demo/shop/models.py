"""An order, and one row per execution of ``send_receipt`` by the worker."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=32)
    total_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.number


class Receipt(models.Model):
    """Written by the worker each time ``send_receipt`` runs.

    Deliberately no foreign key and no unique constraint: a receipt for an order that
    was rolled back, or a second receipt for the same task, must be recordable so the
    demo can count it as a broken guarantee.
    """

    task_id = models.CharField(max_length=255, db_index=True)
    order_id = models.BigIntegerField()
    executed_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"receipt for order {self.order_id} ({self.task_id})"


class Run(models.Model):
    """One run of the other lanes' work, written by whatever ran it.

    ``lane`` says which: ``strict`` (a step of a parcel, run by the worker),
    ``handler`` (a receiver of the handler outbox, run in the demo process right
    after the commit), ``inbox`` and ``inbox-skipped`` (the inbox task's body, or a
    duplicate delivery it acknowledged without running it), ``event:<service>``
    (an event's handler in that service's worker). No constraint: a run that must
    not happen has to be recordable, or the demo could not count it.
    """

    lane = models.CharField(max_length=64)
    key = models.CharField(max_length=255)
    seq = models.IntegerField(default=0)
    #: Strict steps: rows of the same key still in the outbox while this one ran.
    behind = models.IntegerField(null=True)
    executed_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.lane} {self.key} #{self.seq}"
