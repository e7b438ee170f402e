"""Every read and write of the handler-outbox tables, on one database alias (SQL).

Leases: a processor owns a shard while ``lease_token`` holds its token and
``leased_until`` is in the future. Claiming is a compare-and-set UPDATE (after a
``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL and MariaDB/MySQL, so processors
do not queue behind each other), which works on SQLite as well. Every write a
processor makes after its claim is *fenced*: it starts with an UPDATE of the shard
row that matches only while the token is still there. That UPDATE also takes the
row's lock (the write lock on SQLite) until the transaction commits, so another
processor cannot take the shard over between the fence and the commit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import (
    Count,
    DateTimeField,
    DurationField,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Value,
)
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from ...exceptions import OutboxConfigurationError, OutboxDatabaseError, OutboxError
from ...text import storable
from ..base import missing_tables
from .models import (
    HandlerCounter,
    HandlerDeadLetter,
    HandlerMessage,
    HandlerPause,
    HandlerProcessor,
    HandlerShard,
)
from .protocol import HandlerLeases
from .types import (
    ERROR_LIMIT,
    BlockedShard,
    HandlerLeftover,
    HandlerStats,
    Lease,
    LeaseLost,
    Pauses,
    ReplayReport,
    Row,
    ShardDepth,
    StatementRefused,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


#: What a driver raises: the database's errors, and a value it cannot encode.
_DRIVER_ERRORS = (DatabaseError, InterfaceError, UnicodeError)


def translated(
    method: Callable[Concatenate[HandlerStore, _P], _R],
) -> Callable[Concatenate[HandlerStore, _P], _R]:
    """Driver errors of ``method`` become ours (:meth:`HandlerStore.translate`)."""

    @functools.wraps(method)
    def wrapper(store: HandlerStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(store, *args, **kwargs)
        except _DRIVER_ERRORS as exc:
            raise store.translate(exc) from exc

    return wrapper


#: The handler app's tables: one missing means its migrations were not applied.
HANDLER_TABLES = tuple(
    model._meta.db_table
    for model in (
        HandlerMessage,
        HandlerShard,
        HandlerDeadLetter,
        HandlerPause,
        HandlerCounter,
        HandlerProcessor,
    )
)


#: The shard columns of a head that is not failing.
_HEALTHY: dict[str, Any] = {
    "attempts": 0,
    "head_id": None,
    "failing_since": None,
    "last_error": "",
}


def _later(seconds: float) -> ExpressionWrapper[Any]:
    """The database's now plus ``seconds``."""
    return ExpressionWrapper(
        Now() + Value(timedelta(seconds=seconds)), output_field=DateTimeField()
    )


def _free() -> Q:
    return Q(lease_token__isnull=True) | Q(leased_until__lt=Now())


class HandlerStore:
    """The handler-outbox tables on one database alias.

    ``holder``: the member id of the processor that claims through this object
    (its heartbeat's); a processor silent for three beats has its shards taken.
    """

    def __init__(self, using: str, *, holder: str | None = None) -> None:
        self.using = using
        self.holder = holder

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A transaction on the alias whose own failures (begin, commit, rollback)
        become :class:`OutboxDatabaseError`; what the block raises passes through."""
        try:
            with transaction.atomic(using=self.using):
                yield
        except _DRIVER_ERRORS as exc:
            raise self.translate(exc) from exc

    def translate(self, exc: BaseException) -> OutboxError:
        """A driver's error as ours: :class:`OutboxConfigurationError` naming the
        migration when a handler table is missing; :class:`OutboxDatabaseError` for a
        connection that failed; else :class:`StatementRefused`."""
        missing = missing_tables(connections[self.using], HANDLER_TABLES)
        if missing:
            return OutboxConfigurationError(
                f"table missing on handler database {self.using!r}: "
                f"{', '.join(missing)}. Run: python manage.py migrate "
                f"celery_outbox_handlers --database {self.using} (or leave "
                f"{self.using!r} out of CELERY_OUTBOX_HANDLER_DATABASES)"
            )
        lost = isinstance(exc, (OperationalError, InterfaceError))
        kind = OutboxDatabaseError if lost else StatementRefused
        return kind(f"handler database {self.using!r}: {type(exc).__name__}: {exc}")

    def reset_connection(self) -> None:
        """Close this thread's connection to the alias (the next call reconnects)."""
        connections[self.using].close()

    def _shards(self) -> QuerySet[HandlerShard]:
        return cast("QuerySet[HandlerShard]", HandlerShard.objects.using(self.using))

    def _messages(self) -> QuerySet[HandlerMessage]:
        return cast(
            "QuerySet[HandlerMessage]", HandlerMessage.objects.using(self.using)
        )

    # -- the writing side ------------------------------------------------------

    def write(self, category: str, shard: str, object_id: str, payload: str) -> None:
        """INSERT the message, and its shard row when none exists (caller's transaction).

        The shard check is a plain read: it takes no lock on an existing shard row, so
        writers of one shard never wait for each other or for a processor.
        """
        self._messages().create(
            category=category,
            shard=shard,
            object_id=object_id,
            payload=payload,
            created_at=Now(),
        )
        self.ensure_shards([shard])

    @translated
    def ensure_shards(self, shards: Iterable[str]) -> None:
        """Create the shard rows that do not exist (a concurrent creation is ignored)."""
        wanted = set(shards)
        if not wanted:
            return
        existing = set(
            self._shards().filter(shard__in=wanted).values_list("shard", flat=True)
        )
        rows = [
            HandlerShard(shard=key, next_attempt_at=Now(), created_at=Now())
            for key in sorted(wanted - existing)
        ]
        if rows:
            self._shards().bulk_create(rows, ignore_conflicts=True)

    @translated
    def discover(self, limit: int = 1000) -> int:
        """Create shard rows for messages that have none; returns how many were missing.

        A processor deletes the row of a shard it emptied; a message written at that
        moment by a writer that saw the row may then have no shard row. This sweep,
        run every few seconds, puts it back.
        """
        has_shard = Exists(self._shards().filter(shard=OuterRef("shard")))
        missing = list(
            self._messages()
            .filter(~has_shard)
            .order_by()
            .values_list("shard", flat=True)
            .distinct()[:limit]
        )
        self.ensure_shards(missing)
        return len(missing)

    # -- the processing side ---------------------------------------------------

    @translated
    def claim(
        self, token: str, lease_seconds: float, shards: Sequence[str] | None = None
    ) -> Lease | None:
        """Lease the oldest due shard that is not leased or paused (one of ``shards``)."""
        paused = HandlerPause.objects.using(self.using).filter(
            kind=HandlerPause.Kind.SHARD, value=OuterRef("shard")
        )
        due = (
            self._shards()
            .filter(_free(), next_attempt_at__lte=Now())
            .filter(~Exists(paused))
            .order_by("next_attempt_at", "id")
        )
        if shards is not None:
            due = due.filter(shard__in=list(shards))
        with transaction.atomic(using=self.using):
            found = list(
                due.select_for_update(skip_locked=True).values_list(
                    "id", "shard", "attempts", "head_id"
                )[:1]
            )
            if not found:
                return None
            pk, shard, attempts, head_id = found[0]
            won = (
                self._shards()
                .filter(_free(), id=pk)
                .update(
                    lease_token=token,
                    leased_until=_later(lease_seconds),
                    holder=self.holder,
                )
            )
        if not won:
            return None
        return Lease(pk, shard, token, attempts, head_id)

    @translated
    def read(self, lease: Lease, limit: int) -> list[Row]:
        """The first ``limit`` messages of the shard, in id order."""
        age = ExpressionWrapper(Now() - F("created_at"), output_field=DurationField())
        rows = (
            self._messages()
            .filter(shard=lease.shard)
            .order_by("id")
            .annotate(age=age)
            .values_list("id", "category", "object_id", "payload", "created_at", "age")[
                :limit
            ]
        )
        return [
            Row(i, c, o, p, at, None if a is None else a.total_seconds())
            for i, c, o, p, at, a in rows
        ]

    @translated
    def newest(self, lease: Lease, rows: Sequence[Row]) -> dict[tuple[str, str], int]:
        """The newest message id of each (category, object id) of ``rows`` in the shard.

        The whole shard counts, not only the rows read: coalescing supersedes a row
        whose object has a newer message anywhere in its shard.
        """
        if not rows:
            return {}
        categories = {row.category for row in rows}
        objects = {row.object_id for row in rows}
        found = (
            self._messages()
            .filter(
                shard=lease.shard,
                category__in=sorted(categories),
                object_id__in=sorted(objects),
                id__gt=rows[-1].id,
            )
            .order_by()
            .values_list("category", "object_id")
            .annotate(newest=Max("id"))
        )
        return {(c, o): n for c, o, n in found}

    def fence(self, lease: Lease, lease_seconds: float, **changes: Any) -> None:
        """Check the lease, extend it and apply ``changes``, inside the current transaction.

        Raises :class:`LeaseLost` when the token is gone. The row stays locked until
        the surrounding transaction ends.
        """
        updated = (
            self._shards()
            .filter(id=lease.pk, lease_token=lease.token)
            .update(leased_until=_later(lease_seconds), **changes)
        )
        if not updated:
            raise LeaseLost(
                f"the lease on shard {lease.shard!r} ended; another processor owns it"
            )

    @translated
    def complete(self, lease: Lease, message_id: int, lease_seconds: float) -> None:
        """Delete a message whose receiver succeeded (in the receiver's transaction)."""
        self.fence(lease, lease_seconds, **_HEALTHY)
        self._messages().filter(id=message_id, shard=lease.shard).delete()

    @translated
    def discard(
        self,
        lease: Lease,
        ids: Sequence[int],
        counts: dict[str, int],
        lease_seconds: float,
    ) -> None:
        """Delete messages a newer one of the same key supersedes, and count them."""
        with transaction.atomic(using=self.using):
            self.fence(lease, lease_seconds)
            self._messages().filter(id__in=list(ids), shard=lease.shard).delete()
            for category, count in sorted(counts.items()):
                self._count(category, coalesced=count)

    @translated
    def retry_later(
        self, lease: Lease, row: Row, attempts: int, delay: float, error: str
    ) -> None:
        """Back the shard off ``delay`` seconds after its head's ``attempts``-th failure."""
        with transaction.atomic(using=self.using):
            self._shards().filter(id=lease.pk, lease_token=lease.token).update(
                attempts=attempts,
                head_id=row.id,
                last_error=storable(error, ERROR_LIMIT, keep_end=True),
                failing_since=_failing_since(),
                next_attempt_at=_later(delay),
                lease_token=None,
                leased_until=None,
            )

    @translated
    def dead_letter(
        self, lease: Lease, row: Row, attempts: int, error: str, lease_seconds: float
    ) -> None:
        """Move the head to the dead letters; the shard goes on with the next message."""
        shard = lease.shard
        with transaction.atomic(using=self.using):
            self.fence(lease, lease_seconds, **_HEALTHY)
            HandlerDeadLetter.objects.using(self.using).create(
                message_id=row.id,
                category=row.category,
                shard=shard,
                object_id=row.object_id,
                payload=row.payload,
                created_at=row.created_at,
                died_at=Now(),
                attempts=attempts,
                last_error=storable(error, ERROR_LIMIT, keep_end=True),
            )
            self._messages().filter(id=row.id, shard=shard).delete()
            self._count(row.category, dead_lettered=1)

    @translated
    def hold(self, lease: Lease, category: str, recheck_seconds: float) -> None:
        """Stop at a head whose category is paused; look again after ``recheck_seconds``."""
        self._shards().filter(id=lease.pk, lease_token=lease.token).update(
            held_by=category,
            next_attempt_at=_later(recheck_seconds),
            lease_token=None,
            leased_until=None,
        )

    @translated
    def release(self, lease: Lease) -> None:
        """Give the shard up: delete its row when it holds no message, else make it due."""
        has_messages = Exists(self._messages().filter(shard=OuterRef("shard")))
        with transaction.atomic(using=self.using):
            deleted, _ = (
                self._shards()
                .filter(~has_messages, id=lease.pk, lease_token=lease.token)
                .delete()
            )
            if not deleted:
                self.requeue(lease)

    @translated
    def requeue(self, lease: Lease) -> None:
        """Give the lease up with the shard due now (it still holds messages)."""
        self._shards().filter(id=lease.pk, lease_token=lease.token).update(
            held_by="", next_attempt_at=Now(), lease_token=None, leased_until=None
        )

    @translated
    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend the lease; False when it is no longer ours."""
        return bool(
            self._shards()
            .filter(id=lease.pk, lease_token=lease.token)
            .update(leased_until=_later(lease_seconds))
        )

    def _count(self, category: str, **increments: int) -> None:
        counters = HandlerCounter.objects.using(self.using)
        counters.bulk_create([HandlerCounter(category=category)], ignore_conflicts=True)
        counters.filter(category=category).update(
            **{name: F(name) + value for name, value in increments.items()}
        )

    # -- heartbeats (the engine's Membership) ------------------------------------

    @translated
    def beat(self, relay_id: str, name: str) -> None:
        """Record that processor ``relay_id`` is alive now; adds its row if gone."""
        processors = HandlerProcessor.objects.using(self.using)
        with transaction.atomic(using=self.using):
            if not processors.filter(id=relay_id).update(seen_at=Now()):
                processors.bulk_create(
                    [
                        HandlerProcessor(
                            id=relay_id, name=storable(name, 255), seen_at=Now()
                        )
                    ],
                    ignore_conflicts=True,
                )

    @translated
    def take_over(self, stale_seconds: float) -> int:
        """End the leases of processors silent for ``stale_seconds``; how many shards.

        Their shards become due at once, as if their lease had run out: the token
        stays, so a late write of the silent processor still finds it only until
        another processor claims the shard.
        """
        processors = HandlerProcessor.objects.using(self.using)
        with transaction.atomic(using=self.using):
            stale = list(
                processors.filter(seen_at__lt=_later(-stale_seconds))
                .select_for_update(skip_locked=True)
                .values_list("id", flat=True)
            )
            if not stale:
                return 0
            ended: int = (
                self._shards()
                .filter(holder__in=stale, lease_token__isnull=False)
                .update(leased_until=_later(-1.0), holder=None)
            )
            processors.filter(id__in=stale).delete()
        return ended

    @translated
    def leave(self, relay_id: str) -> None:
        """Remove processor ``relay_id``'s heartbeat (it stops cleanly)."""
        HandlerProcessor.objects.using(self.using).filter(id=relay_id).delete()

    # -- dead-letter retention --------------------------------------------------

    @translated
    def purge_dead_letters(self, older_than: float, chunk: int = 1000) -> int:
        """Delete dead letters that died over ``older_than`` seconds ago; how many."""
        dead = HandlerDeadLetter.objects.using(self.using)
        deleted = 0
        while True:
            with transaction.atomic(using=self.using):
                ids = list(
                    dead.filter(died_at__lt=_later(-older_than))
                    .order_by("id")
                    .values_list("id", flat=True)[:chunk]
                )
                if ids:
                    deleted += dead.filter(id__in=ids).delete()[0]
            if len(ids) < chunk:
                return deleted

    # -- kill switches ----------------------------------------------------------

    @translated
    def pauses(self) -> Pauses:
        """The categories and shards paused on this database."""
        rows = HandlerPause.objects.using(self.using).values_list("kind", "value")
        categories = {v for k, v in rows if k == HandlerPause.Kind.CATEGORY}
        shards = {v for k, v in rows if k == HandlerPause.Kind.SHARD}
        return Pauses(frozenset(categories), frozenset(shards))

    @translated
    def pause(self, kind: str, value: str, reason: str = "") -> bool:
        """Pause a ``"category"`` or a ``"shard"``; False when it was already paused."""
        kind = HandlerPause.Kind(kind)
        if self.is_paused(kind, value):
            return False
        HandlerPause.objects.using(self.using).bulk_create(
            [
                HandlerPause(
                    kind=kind,
                    value=value,
                    reason=storable(reason),
                    created_at=Now(),
                )
            ],
            ignore_conflicts=True,
        )
        return True

    @translated
    def is_paused(self, kind: str, value: str) -> bool:
        """Whether a pause row exists for (kind, value)."""
        pauses = HandlerPause.objects.using(self.using)
        return bool(pauses.filter(kind=kind, value=value).exists())

    @translated
    def knows_category(self, category: str) -> bool:
        """Whether messages or dead letters of ``category`` are on this database."""
        dead = HandlerDeadLetter.objects.using(self.using)
        return bool(
            self._messages().filter(category=category).exists()
            or dead.filter(category=category).exists()
        )

    @translated
    def resume(self, kind: str, value: str) -> bool:
        """Lift a pause; the shards it stopped are due at once. False when none was set."""
        with transaction.atomic(using=self.using):
            deleted, _ = (
                HandlerPause.objects.using(self.using)
                .filter(kind=kind, value=value)
                .delete()
            )
            if kind == HandlerPause.Kind.CATEGORY:
                stopped = self._shards().filter(held_by=value)
            else:
                stopped = self._shards().filter(shard=value, attempts=0)
            stopped.update(held_by="", next_attempt_at=Now())
        return bool(deleted)

    # -- what operators look at ---------------------------------------------------

    @translated
    def stats(self, top: int = 10) -> HandlerStats:
        """Counts, ages and the ``top`` deepest shards."""
        now = timezone.now()
        messages = self._messages()
        shards = self._shards()
        pauses = self.pauses()
        stuck = Q(attempts__gt=0) | ~Q(held_by="") | Q(shard__in=pauses.shards)
        flowing = messages.exclude(shard__in=shards.filter(stuck).values("shard"))
        deepest = (
            messages.order_by()
            .values("shard")
            .annotate(n=Count("id"))
            .order_by("-n", "shard")[:top]
        )
        counters = HandlerCounter.objects.using(self.using).order_by("category")
        return HandlerStats(
            database=self.using,
            messages=messages.count(),
            shards=shards.count(),
            blocked=shards.filter(attempts__gt=0).count(),
            paused_shards=shards.filter(
                ~Q(held_by="") | Q(shard__in=pauses.shards)
            ).count(),
            paused_categories=tuple(sorted(pauses.categories)),
            paused_shard_keys=tuple(sorted(pauses.shards)),
            oldest_age=_age(now, messages.aggregate(m=Min("created_at"))["m"]),
            lag=_age(now, flowing.aggregate(m=Min("created_at"))["m"]),
            dead_letters=HandlerDeadLetter.objects.using(self.using).count(),
            coalesced={c.category: c.coalesced for c in counters if c.coalesced},
            dead_lettered={
                c.category: c.dead_lettered for c in counters if c.dead_lettered
            },
            deepest=tuple(ShardDepth(d["shard"], d["n"]) for d in deepest),
            waiting=shards.filter(_free(), next_attempt_at__lte=Now())
            .exclude(shard__in=pauses.shards)
            .count(),
            leased=shards.exclude(_free()).count(),
            blocked_shards=self._blocked(now, top),
        )

    @translated
    def leftover(self) -> HandlerLeftover:
        """The messages no processor holds, by what they wait for; three reads.

        One count of the messages by their shard's state, the shard failing
        longest, and the pauses that hold a shard.
        """
        pauses = HandlerPause.objects.using(self.using)
        paused = Q(
            shard__in=pauses.filter(kind=HandlerPause.Kind.SHARD).values("value")
        ) | Q(
            held_by__in=pauses.filter(kind=HandlerPause.Kind.CATEGORY).values("value")
        )
        unheld = self._shards().filter(_free())
        healthy = unheld.filter(attempts=0)

        def of(shards: QuerySet[HandlerShard]) -> Exists:
            return Exists(shards.filter(shard=OuterRef("shard")))

        failing = of(unheld.filter(attempts__gt=0))
        counts = self._messages().aggregate(
            failing=Count("id", filter=failing),
            failing_shards=Count("shard", distinct=True, filter=failing),
            waiting=Count("id", filter=of(healthy.exclude(paused))),
            held=Count("id", filter=of(healthy.filter(paused))),
        )
        first = (
            unheld.filter(attempts__gt=0)
            .order_by("failing_since", "id")
            .values_list("shard", "last_error")
            .first()
        )
        holding = pauses.annotate(
            by_shard=Exists(healthy.filter(shard=OuterRef("value"))),
            by_category=Exists(healthy.filter(held_by=OuterRef("value"))),
        ).order_by("value")
        rows = list(holding.values_list("kind", "value", "by_shard", "by_category"))
        return HandlerLeftover(
            database=self.using,
            failing=counts["failing"],
            failing_shards=counts["failing_shards"],
            failing_shard=first[0] if first else "",
            failing_error=first[1] if first else "",
            waiting=counts["waiting"],
            held=counts["held"],
            held_by_shards=tuple(
                v for k, v, s, _ in rows if k == HandlerPause.Kind.SHARD and s
            ),
            held_by_categories=tuple(
                v for k, v, _, c in rows if k == HandlerPause.Kind.CATEGORY and c
            ),
        )

    def _blocked(self, now: datetime, top: int) -> tuple[BlockedShard, ...]:
        """The ``top`` shards failing longest, with their head's category."""
        failing = list(
            self._shards()
            .filter(attempts__gt=0)
            .order_by("failing_since", "id")
            .values_list(
                "shard",
                "head_id",
                "attempts",
                "failing_since",
                "next_attempt_at",
                "last_error",
            )[:top]
        )
        heads = [head for _, head, *_ in failing if head is not None]
        categories = dict(
            self._messages().filter(id__in=heads).values_list("id", "category")
        )
        return tuple(
            BlockedShard(
                shard=shard,
                head_id=head,
                category=categories.get(head, "") if head is not None else "",
                attempts=attempts,
                failing_seconds=_age(now, since),
                next_attempt_seconds=max(0.0, (due - now).total_seconds()),
                last_error=error,
            )
            for shard, head, attempts, since, due, error in failing
        )

    # -- dead letters ------------------------------------------------------------

    @translated
    def replay(
        self,
        *,
        ids: Sequence[int] | None = None,
        category: str | None = None,
        shard: str | None = None,
        coalesces: Callable[[str], bool] = lambda _category: False,
        chunk: int = 500,
        dry_run: bool = False,
    ) -> ReplayReport:
        """Write dead letters back as new messages at the end of their shards.

        Every dead letter matching all the given filters (None: any), in the order
        they were first written, ``chunk`` per transaction. A replayed message runs
        after everything its shard already holds, with fresh attempts. One whose
        category ``coalesces`` and whose object has a newer message waiting in the
        shard is left in the dead letters: replaying it would put the older payload
        after the newer one. ``dry_run`` writes nothing and reports what would be
        done.
        """
        dead = HandlerDeadLetter.objects.using(self.using).order_by("message_id", "id")
        if ids is not None:
            dead = dead.filter(id__in=list(ids))
        if category is not None:
            dead = dead.filter(category=category)
        if shard is not None:
            dead = dead.filter(shard=shard)
        replayed: list[int] = []
        superseded: list[int] = []
        after: tuple[int, int] = (-1, -1)
        while True:
            with transaction.atomic(using=self.using):
                page_query = dead.filter(
                    Q(message_id__gt=after[0]) | Q(message_id=after[0], id__gt=after[1])
                )
                if not dry_run:
                    page_query = page_query.select_for_update()
                page = list(page_query[:chunk])
                if not page:
                    break
                after = (page[-1].message_id, page[-1].id)
                kept = []
                for letter in page:
                    if coalesces(letter.category) and self._newer(letter):
                        superseded.append(letter.id)
                    else:
                        kept.append(letter)
                if not dry_run:
                    self._write_back(kept)
                replayed.extend(d.id for d in kept)
        return ReplayReport(
            self.using,
            len(replayed),
            len(superseded),
            tuple(replayed),
            tuple(superseded),
            dry_run,
        )

    def _newer(self, dead: HandlerDeadLetter) -> bool:
        """Whether a message of the dead letter's object, written after it, waits."""
        return bool(
            self._messages()
            .filter(
                shard=dead.shard,
                category=dead.category,
                object_id=dead.object_id,
                id__gt=dead.message_id,
            )
            .exists()
        )

    def _write_back(self, dead: Sequence[HandlerDeadLetter]) -> None:
        """New messages for ``dead`` (in order), their shard rows, and no dead letters."""
        if not dead:
            return
        # One INSERT per message keeps the ids in the dead letters' order everywhere.
        for letter in dead:
            self._messages().create(
                category=letter.category,
                shard=letter.shard,
                object_id=letter.object_id,
                payload=letter.payload,
                created_at=Now(),
            )
        self.ensure_shards({letter.shard for letter in dead})
        HandlerDeadLetter.objects.using(self.using).filter(
            id__in=[letter.id for letter in dead]
        ).delete()


def _failing_since() -> Any:
    return Coalesce(F("failing_since"), Now(), output_field=DateTimeField())


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


class HandlerMembers:
    """The engine's ``Membership`` over every database a processor serves.

    A processor beats on each of its databases; a database that fails is logged by
    the heartbeat and the others still beat.
    """

    def __init__(self, stores: Sequence[HandlerLeases], holder: str) -> None:
        self.stores = list(stores)
        self.holder: str | None = holder

    def beat(self, relay_id: str, name: str) -> None:
        """Beat on every database; the first failure is raised once all were tried."""
        self._each(lambda store: store.beat(relay_id, name))

    def take_over(self, stale_seconds: float) -> int:
        """Take over silent processors' shards on every database; how many."""
        taken = [0]

        def one(store: HandlerLeases) -> None:
            taken[0] += store.take_over(stale_seconds)

        self._each(one)
        return taken[0]

    def leave(self, relay_id: str) -> None:
        """Remove this processor's heartbeat rows."""
        self._each(lambda store: store.leave(relay_id))

    def reset_connection(self) -> None:
        """Close this thread's connections."""
        for store in self.stores:
            store.reset_connection()

    def _each(self, call: Callable[[HandlerLeases], None]) -> None:
        failed: OutboxDatabaseError | None = None
        for store in self.stores:
            try:
                call(store)
            except OutboxDatabaseError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
