"""The exit statuses of every ``outbox`` command: the one table the commands read.

docs/reference.md ("Exit statuses") prints the same table; a test holds the two
together.
"""

from __future__ import annotations

import enum

from ..engine.observations import StopReason


class ExitStatus(enum.IntEnum):
    """What a command's exit status says."""

    #: Done: the verb did what it was asked; a process stopped by a signal, or
    #: run ``--until-empty`` with nothing left it could send.
    OK = 0
    #: Failed, saying why on stderr: an error (a database or broker that did not
    #: answer, missing tables, a selector that matches nothing), or a run
    #: ``--until-empty`` that left work it could have done undone.
    FAILED = 1
    #: The command line is wrong (an unknown flag, a missing argument, text no
    #: row can hold): nothing was done.
    USAGE = 2
    #: A run ``--until-empty`` stopped with work left that only a limit holds back
    #: (a flow's rate, a flow key at its limit, an ordered key's head, a paused
    #: handler shard or category): nothing it could send is left, and the outbox
    #: is not empty.
    HELD = 3


#: The exit status of a process (``relay``, ``handlers run``) stopped for each reason.
STOPPED = {
    StopReason.SIGNAL: ExitStatus.OK,
    StopReason.EMPTY: ExitStatus.OK,
    StopReason.UNFINISHED: ExitStatus.FAILED,
    StopReason.HELD: ExitStatus.HELD,
}


def exit_status(reason: StopReason) -> ExitStatus:
    """The exit status of a process whose loop stopped for ``reason``."""
    return STOPPED[reason]
