"""Ordered and coalesced tasks: ``apply_async(..., ordering_key="org:42")``.

* Publish order (any keyed call): within a key, rows go to the broker in id order,
  one key's rows never from two relays at once (the claim's head rule,
  :meth:`celery_outbox.store.dialects.Dialect._due_where`).
* Execution order (``ordering="strict"``): the next row of a key is published only
  once the worker reported the previous one finished (:mod:`.worker`).
* Head-of-line policy (``ordering_policy="block"`` or ``"skip"``) for a head that
  fails for good; coalescing (``coalesce=True`` or ``coalesce_key=``).

The pure decisions are in :mod:`.core`, the gate that applies them in :mod:`.gate`,
the call options in :mod:`celery_outbox.ordering_options` (below the stores and the
engine, which read them), the SQL and the claim's run of a key in
:mod:`celery_outbox.store.ordering`. See docs/ordering.md.
"""

from __future__ import annotations

from ..ordering_options import HEADER, Ordering, Policy

__all__ = ["HEADER", "Ordering", "Policy"]
