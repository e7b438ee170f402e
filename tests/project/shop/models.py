"""Business data of the test project, and a record of every task execution."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    number = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)


class TaskRun(models.Model):
    """One execution of a task by a real worker (duplicates show as several rows)."""

    task_id = models.CharField(max_length=255, db_index=True)
    task_name = models.CharField(max_length=255)
    tag = models.CharField(max_length=255, db_index=True)
    value = models.TextField(blank=True, default="")
    ran_at = models.DateTimeField(auto_now_add=True)
