"""Tables of the handler outboxes (the ``celery_outbox.handlers`` app's models).

Only :mod:`celery_outbox.store.handlers` reads or writes them (the admin lists them).
Times are written by the database clock, so processors on hosts whose clocks drift
still agree on leases and backoff.
"""

from __future__ import annotations

from django.db import models

from .types import KEY_LENGTH

#: The handler app's label: these tables are its own (migrations in
#: ``celery_outbox/handlers/migrations/``), defined here beside their store.
APP_LABEL = "celery_outbox_handlers"


class HandlerMessage(models.Model):
    """One emitted message, waiting for its receiver; deleted once it ran."""

    id = models.BigAutoField(primary_key=True)
    category = models.CharField(max_length=KEY_LENGTH)
    #: ``scope:identifier``: the messages of one shard run one at a time, in id order.
    shard = models.CharField(max_length=KEY_LENGTH)
    object_id = models.CharField(max_length=KEY_LENGTH)
    #: JSON text.
    payload = models.TextField()
    created_at = models.DateTimeField()

    class Meta:
        app_label = APP_LABEL
        db_table = "celery_outbox_handler_message"
        verbose_name = "handler message"
        indexes = [
            models.Index(fields=["shard", "id"], name="co_handler_msg_shard_idx"),
            # The newest message of an object in its shard (coalescing).
            models.Index(
                fields=["shard", "category", "object_id", "id"],
                name="co_handler_msg_object_idx",
            ),
            models.Index(fields=["created_at"], name="co_handler_msg_age_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.category} {self.shard} {self.object_id}"


class HandlerShard(models.Model):
    """A shard with messages: its lease, and the backoff of its failing head."""

    id = models.BigAutoField(primary_key=True)
    shard = models.CharField(max_length=KEY_LENGTH, unique=True)
    #: Set while one processor owns the shard; every write it makes checks it.
    lease_token = models.CharField(max_length=32, null=True, blank=True)
    leased_until = models.DateTimeField(null=True, blank=True)
    #: The member id (:class:`HandlerProcessor`) of the processor holding the lease:
    #: when it stops beating, another processor ends the lease at once.
    holder = models.CharField(max_length=32, null=True, blank=True)
    #: When a processor may claim the shard (later than now while the head backs off).
    next_attempt_at = models.DateTimeField()
    #: Failed runs of the head message ``head_id``; 0 when the head is not failing.
    attempts = models.IntegerField(default=0)
    head_id = models.BigIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    failing_since = models.DateTimeField(null=True, blank=True)
    #: The paused category that stopped the shard at its head, if any.
    held_by = models.CharField(max_length=KEY_LENGTH, blank=True, default="")
    created_at = models.DateTimeField()

    class Meta:
        app_label = APP_LABEL
        db_table = "celery_outbox_handler_shard"
        verbose_name = "handler shard"
        indexes = [
            models.Index(
                fields=["next_attempt_at", "id"], name="co_handler_shard_due_idx"
            ),
            models.Index(fields=["held_by"], name="co_handler_shard_held_idx"),
            models.Index(fields=["holder"], name="co_handler_shard_holder_idx"),
        ]

    def __str__(self) -> str:
        return self.shard


class HandlerDeadLetter(models.Model):
    """A message whose receiver failed ``max_attempts`` times, kept with the last error."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.BigIntegerField()
    category = models.CharField(max_length=KEY_LENGTH)
    shard = models.CharField(max_length=KEY_LENGTH)
    object_id = models.CharField(max_length=KEY_LENGTH)
    payload = models.TextField()
    created_at = models.DateTimeField()
    died_at = models.DateTimeField()
    attempts = models.IntegerField()
    last_error = models.TextField(blank=True, default="")

    class Meta:
        app_label = APP_LABEL
        db_table = "celery_outbox_handler_deadletter"
        verbose_name = "handler dead letter"
        indexes = [
            models.Index(fields=["died_at"], name="co_handler_dead_age_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.category} {self.shard} {self.object_id}"


class HandlerPause(models.Model):
    """A kill switch: no receiver runs for this category, or in this shard, until deleted."""

    class Kind(models.TextChoices):
        CATEGORY = "category"
        SHARD = "shard"

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    value = models.CharField(max_length=KEY_LENGTH)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()

    class Meta:
        app_label = APP_LABEL
        db_table = "celery_outbox_handler_pause"
        verbose_name = "handler pause"
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "value"], name="co_handler_pause_uniq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.value}"


class HandlerCounter(models.Model):
    """Running totals per category: messages coalesced away, messages dead-lettered."""

    id = models.BigAutoField(primary_key=True)
    category = models.CharField(max_length=KEY_LENGTH, unique=True)
    coalesced = models.BigIntegerField(default=0)
    dead_lettered = models.BigIntegerField(default=0)

    class Meta:
        app_label = APP_LABEL
        db_table = "celery_outbox_handler_counter"
        verbose_name = "handler counter"

    def __str__(self) -> str:
        return self.category


class HandlerProcessor(models.Model):
    """A running processor's heartbeat: silent for three beats, its shards are taken."""

    id = models.CharField(max_length=32, primary_key=True)
    #: ``host:pid``, for operators.
    name = models.CharField(max_length=255)
    seen_at = models.DateTimeField()

    class Meta:
        app_label = APP_LABEL
        db_table = "celery_outbox_handler_processor"
        verbose_name = "handler processor"

    def __str__(self) -> str:
        return self.name
