"""The business row each benchmarked transaction writes."""

from __future__ import annotations

from django.db import models


class BenchOrder(models.Model):
    number = models.CharField(max_length=64)
    amount = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
