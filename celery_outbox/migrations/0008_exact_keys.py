"""Placeholder for the keys branch's 0008_exact_keys (replaced by it at merge)."""

from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0007_history"),
    ]

    operations = []
