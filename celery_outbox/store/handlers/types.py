"""The values the handler store and the processor pass each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ...exceptions import OutboxDatabaseError, OutboxError
from ...text import ERROR_LIMIT as _TEXT_LIMIT

#: Widest shard key, category and object id (characters; fits a utf8mb4 unique index).
KEY_LENGTH = 255

#: Characters of a receiver's error kept on the shard and in a dead letter (its end).
ERROR_LIMIT = _TEXT_LIMIT


@dataclass(frozen=True)
class Row:
    """One stored message as the processor reads it."""

    id: int
    category: str
    object_id: str
    payload: str
    created_at: datetime
    #: Seconds since the message was written, by the database's clock at the read.
    age_seconds: float | None = None


class LeaseLost(OutboxError):
    """The shard's lease ended and another processor may own it: the write was not made."""


class StatementRefused(OutboxDatabaseError):
    """The database answered, and refused a statement or the commit (not a lost
    connection). In an atomic receiver's transaction, that is the receiver's failure:
    one that swallowed a database error left PostgreSQL's transaction aborted."""


@dataclass(frozen=True)
class Lease:
    """A shard this processor owns, and the state of its head at the claim."""

    pk: int
    shard: str
    token: str
    attempts: int
    head_id: int | None


@dataclass(frozen=True)
class Pauses:
    """The kill switches in force on one database."""

    categories: frozenset[str] = frozenset()
    shards: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ShardDepth:
    """A shard and how many messages wait in it."""

    shard: str
    messages: int


@dataclass(frozen=True)
class BlockedShard:
    """A shard whose head keeps failing, with what an operator needs to act."""

    shard: str
    #: The failing message and its category ("" once the message is gone).
    head_id: int | None
    category: str
    attempts: int
    #: Seconds since the head first failed.
    failing_seconds: float | None
    #: Seconds until its next attempt (0 when due).
    next_attempt_seconds: float
    last_error: str


@dataclass(frozen=True)
class ReplayReport:
    """What a replay of handler dead letters did on one database."""

    database: str
    #: Dead letters written back as new messages at the end of their shards.
    replayed: int
    #: Dead letters left where they are: a newer message of their object waits in
    #: their shard (their category coalesces), which would run instead of them.
    superseded: int
    #: Ids of the dead letters replayed.
    ids: tuple[int, ...] = ()
    #: Ids of the dead letters left (``superseded``).
    superseded_ids: tuple[int, ...] = ()
    #: Nothing was written: ``replayed`` counts what would have been.
    dry_run: bool = False


@dataclass(frozen=True)
class HandlerStats:
    """The backlog of the handler outboxes on one database."""

    database: str
    messages: int
    shards: int
    #: Shards whose head failed and waits for its next attempt.
    blocked: int
    #: Shards stopped by a paused category at their head, or paused themselves.
    paused_shards: int
    paused_categories: tuple[str, ...]
    paused_shard_keys: tuple[str, ...]
    #: Age of the oldest message waiting anywhere (seconds), None when empty.
    oldest_age: float | None
    #: Age of the oldest message in a shard that is neither blocked nor paused.
    lag: float | None
    dead_letters: int
    coalesced: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    deepest: tuple[ShardDepth, ...] = ()
    #: Shards due now that no processor holds (a processor would claim them next).
    waiting: int = 0
    #: Shards a processor holds now.
    leased: int = 0
    #: The shards that have failed longest (at most ``top``).
    blocked_shards: tuple[BlockedShard, ...] = ()


@dataclass(frozen=True)
class HandlerLeftover:
    """The messages waiting on one database that no processor holds, by what they
    wait for; read when a run ``--until-empty`` ends.

    A shard leased to a processor is not counted: that processor is running it (a
    dead one's lease ends within three of its missed beats, or at the lease's end).
    """

    database: str
    #: Messages in shards whose head failed and waits for its retry (backing off),
    #: paused or not: lifting a pause does not make a failing receiver succeed.
    failing: int = 0
    failing_shards: int = 0
    #: The shard failing longest, and its last error (as ``handlers stats`` lists it).
    failing_shard: str = ""
    failing_error: str = ""
    #: Messages in shards due and not failing that no pause holds: written after
    #: the last look, or stopped by a pause lifted since.
    waiting: int = 0
    #: Messages only a pause holds: their shard is paused, or stopped at a head whose
    #: category is paused.
    held: int = 0
    #: The pauses holding them.
    held_by_shards: tuple[str, ...] = ()
    held_by_categories: tuple[str, ...] = ()
