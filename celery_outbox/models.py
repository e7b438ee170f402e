"""The outbox and dead-letter tables.

Only :mod:`celery_outbox.store` reads or writes these tables; the models exist for
migrations and the admin. Times are written by the database clock.
"""

from __future__ import annotations

from django.db import models


class MessageFields(models.Model):
    """Columns shared by a waiting message and a dead letter: the whole broker message."""

    #: Indexed by each table's ``Meta.indexes``: a plain index, without the second
    #: one (for ``LIKE 'prefix%'``) that ``db_index`` adds on PostgreSQL, which no
    #: query uses and every insert and claim would keep up to date.
    task_id = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    queue = models.CharField(max_length=255, blank=True, default="")
    exchange = models.CharField(max_length=255, blank=True, default="")
    routing_key = models.CharField(max_length=255, blank=True, default="")
    ordering_key = models.CharField(max_length=255, null=True, blank=True)
    payload_version = models.PositiveSmallIntegerField()
    body = models.BinaryField()
    content_type = models.CharField(max_length=128)
    content_encoding = models.CharField(max_length=64)
    headers = models.TextField(help_text="Message headers, JSON (kombu encoding).")
    properties = models.TextField(
        help_text="Message properties, JSON (kombu encoding)."
    )
    declare_queues = models.TextField(
        default="[]", help_text="Queue names declared before publish, JSON."
    )
    arguments_preview = models.TextField(blank=True, default="")
    #: Nullable so that rows written by an older version during a rolling deploy still
    #: insert; NULL reads as an empty context.
    log_context = models.TextField(
        null=True,
        blank=True,
        default="{}",
        help_text="Log context variables captured at enqueue, JSON; never sent to the broker.",
    )
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"


class OutboxMessage(MessageFields):
    """A task written in the caller's transaction and not yet confirmed by the broker.

    ``available_at`` is when the row may next be claimed: a claim moves it to the end
    of the lease, a failure to the next retry. ``lease_token`` is set while a relay
    holds the row; every write after the claim is fenced by it. ``holder`` names the
    relay (:class:`RelayHeartbeat`) whose claim holds the row: once that relay stops
    beating, another one ends the lease early instead of waiting it out.
    """

    id = models.BigAutoField(primary_key=True)
    available_at = models.DateTimeField()
    lease_token = models.CharField(max_length=32, null=True, blank=True)
    #: NULL for rows claimed by publish-on-commit or by an older version: those
    #: keep the lease-only behaviour. Deliberately not indexed (see the migration).
    holder = models.CharField(max_length=32, null=True, blank=True)
    #: Ordered keys only (:mod:`celery_outbox.ordering`): ``running`` while a strict
    #: head waits for its worker, ``blocked`` while a failed head waits for an
    #: operator. NULL otherwise, so that the enqueue path never writes it.
    state = models.CharField(max_length=8, null=True, blank=True)
    #: Scheduled tasks only (an ETA beyond ``CELERY_OUTBOX_SCHEDULE_AFTER``): when the
    #: task falls due, on the database clock. Ages count from it (a scheduled task is
    #: not late while it waits). NULL otherwise: other rows never write it.
    due_at = models.DateTimeField(null=True, blank=True)
    #: Rows waiting for a slot of their flow key only (``state`` ``parked``,
    #: :mod:`celery_outbox.flow`): the key whose worker's report wakes them. NULL
    #: otherwise, so that the enqueue path never writes it. Its index
    #: (``celery_outbox_flowkey_idx``, migration 0011) holds the parked rows only
    #: where the database has partial indexes: not declared here, where Django would
    #: warn on MySQL that it cannot be partial.
    flow_key = models.CharField(max_length=255, null=True, blank=True)

    class Meta:
        db_table = "celery_outbox_message"
        verbose_name = "outbox message"
        indexes = [
            models.Index(fields=["available_at", "id"], name="celery_outbox_due_idx"),
            models.Index(fields=["task_id"], name="celery_outbox_task_idx"),
            #: Finds a key's head (its lowest id) for the claim's head rule.
            models.Index(fields=["ordering_key", "id"], name="celery_outbox_key_idx"),
        ]


class DeadLetter(MessageFields):
    """A message that used up its attempts; it keeps everything needed to replay it."""

    id = models.BigAutoField(primary_key=True)
    original_id = models.BigIntegerField()
    dead_at = models.DateTimeField(db_index=True)

    class Meta:
        db_table = "celery_outbox_deadletter"
        verbose_name = "dead letter"
        indexes = [
            models.Index(fields=["task_id"], name="celery_outbox_dead_task_idx"),
        ]


class RelayHeartbeat(models.Model):
    """A running relay: it writes ``seen_at`` (database clock) every few seconds.

    A relay whose row is older than a few intervals is taken for dead (killed,
    its host lost): the leases of the rows it holds are ended at once, so another
    relay publishes them again without waiting for the lease to run out.
    """

    id = models.CharField(primary_key=True, max_length=32)
    name = models.CharField(max_length=255, blank=True, default="")
    seen_at = models.DateTimeField()

    class Meta:
        db_table = "celery_outbox_relay"
        verbose_name = "relay heartbeat"

    def __str__(self) -> str:
        return f"{self.name or self.id} (seen {self.seen_at})"


class DedupKey(models.Model):
    """A caller's ``dedup_key`` and the task that holds it.

    The key is held while that task's row waits in the outbox, and until ``held_until``
    (the call's ``dedup_window`` after the enqueue): a second enqueue with a held key
    writes nothing and gets the holder's ``AsyncResult``. The primary key makes two
    concurrent enqueues of one key wait for each other, on every database.
    """

    dedup_key = models.CharField(primary_key=True, max_length=255)
    task_id = models.CharField(max_length=255)
    held_until = models.DateTimeField()

    class Meta:
        db_table = "celery_outbox_dedup_key"
        verbose_name = "deduplication key"

    def __str__(self) -> str:
        return f"{self.dedup_key} -> {self.task_id}"


class DedupSlot(models.Model):
    """A row that writers of a ``dedup_key`` no row holds yet lock, on MySQL/MariaDB.

    The rows exist before anyone locks them and are never deleted, so waiting for one
    is an exclusive row lock InnoDB queues and sees in its deadlock detection (a
    rollback hands it to the next writer; no shared locks of a duplicate key meet).
    A key's slot is a hash of the key modulo
    :data:`celery_outbox.store.dialects.DEDUP_SLOTS`. Not managed by
    Django: a test run's flush would empty it; migration 0014 creates and fills it.
    """

    slot = models.PositiveIntegerField(primary_key=True)

    class Meta:
        managed = False
        db_table = "celery_outbox_dedup_slot"
        verbose_name = "deduplication slot"

    def __str__(self) -> str:
        return str(self.slot)


class HistoryEvent(models.Model):
    """One thing that happened to a message, kept with ``CELERY_OUTBOX_HISTORY`` on.

    Written by the store in the statements that settle a batch (one INSERT for many
    messages): ``published``, ``retrying`` (the broker refused an attempt),
    ``blocked``, ``dead``, ``replayed`` and ``revoked``. ``enqueued_at`` is the row's
    ``created_at`` when the event was written, so no write is added to the enqueue.
    Kept for ``CELERY_OUTBOX_HISTORY_RETENTION``; found by task id.
    """

    id = models.BigAutoField(primary_key=True)
    task_id = models.CharField(max_length=255)
    task_name = models.CharField(max_length=255)
    event = models.CharField(max_length=16)
    #: When it happened (database clock). Not indexed: the purge finds old rows in
    #: id order, and every index would cost each settlement an update.
    at = models.DateTimeField()
    enqueued_at = models.DateTimeField()
    #: Attempts used by the message once this event happened.
    attempt = models.PositiveIntegerField(default=0)
    #: The broker's reason for a refusal, a dead letter, or a replayed dead letter.
    error = models.TextField(blank=True, default="")
    #: The heartbeat id of the relay that wrote the event (NULL: publish-on-commit,
    #: a command or the admin).
    relay_id = models.CharField(max_length=32, null=True, blank=True)
    #: ``host:pid`` of the process that wrote it.
    process = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        db_table = "celery_outbox_history"
        verbose_name = "history event"
        indexes = [
            models.Index(fields=["task_id"], name="celery_outbox_history_task_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] {self.event}"


class FlowState(models.Model):
    """One flow of ``CELERY_OUTBOX_FLOWS``: the row every relay locks to decide for it.

    A relay deciding what the flow may publish holds this row's lock while it reads
    the window and records what it is about to publish: relays take turns per flow.
    ``rates`` is an operator's change of the settings' rates (``outbox flows rate``),
    read at each decision; NULL keeps the settings'.
    """

    name = models.CharField(primary_key=True, max_length=255)
    rates = models.CharField(max_length=255, null=True, blank=True)
    changed_at = models.DateTimeField(null=True, blank=True)
    #: When the rows held back so far have all had their slot at the rate: rows held
    #: next are given slots after it (database clock).
    paced_until = models.DateTimeField(null=True, blank=True)
    #: An operator's change of the settings' limits per key (``outbox flows
    #: limit``), JSON as the setting writes them; NULL keeps the settings'.
    limits = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "celery_outbox_flow"
        verbose_name = "flow"

    def __str__(self) -> str:
        return f"{self.name} ({self.rates or 'rates of the settings'})"


class FlowRecord(models.Model):
    """Publishes a relay recorded for a flow, before sending them (database clock).

    The window of a rate is the sum of the records younger than it; records older
    than the flow's longest window are deleted by the next decision.
    """

    id = models.BigAutoField(primary_key=True)
    flow = models.CharField(max_length=255)
    at = models.DateTimeField()
    tasks = models.PositiveIntegerField()

    class Meta:
        db_table = "celery_outbox_flow_record"
        verbose_name = "flow record"
        indexes = [
            models.Index(fields=["flow", "at"], name="celery_outbox_flow_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.flow}: {self.tasks} at {self.at}"


class FlowSlot(models.Model):
    """A published task of a flow key that its worker has not reported finished.

    The gate writes it when it lets the task go; the worker marks it started and
    deletes it when the task ends. A started slot past ``expires_at`` (its worker died
    with the report) no longer counts and is deleted by the next decision; an
    unstarted one stays while its queue still holds its task.
    """

    id = models.BigAutoField(primary_key=True)
    flow = models.CharField(max_length=255)
    flow_key = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255)
    #: The broker queue its task went to: an unstarted slot past ``expires_at``
    #: stays while the queue still holds its task (see ``flow_limits.outlived``).
    queue = models.CharField(max_length=255, default="", blank=True)
    started = models.BooleanField(default=False)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "celery_outbox_flow_slot"
        verbose_name = "flow slot"
        indexes = [
            models.Index(
                fields=["flow", "flow_key"], name="celery_outbox_slot_key_idx"
            ),
            models.Index(
                fields=["flow", "task_id"], name="celery_outbox_slot_task_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.flow} {self.flow_key}: {self.task_id}"
