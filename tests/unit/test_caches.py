"""The package's process-wide caches: bounded, and emptied by one reset and by fork."""

from __future__ import annotations

import subprocess
import sys

from celery_outbox import caches
from celery_outbox.store.notify import HINTS


def test_a_full_cache_starts_over() -> None:
    cache: caches.BoundedCache[str, int] = caches.BoundedCache("test", 2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)
    assert (len(cache), cache.get("a"), cache.get("c")) == (1, None, 3)


def test_reset_empties_every_registered_cache_and_the_hint_clock() -> None:
    cache: caches.BoundedCache[str, int] = caches.bounded_cache("test.reset", 8)
    cache.put("kept", 1)
    HINTS.committed()
    assert not HINTS.due()
    caches.reset()
    assert cache.get("kept") is None
    assert HINTS.due()


#: Run in a fresh interpreter: forking pytest (with its threads) is what Python
#: warns about.
FORK = """
import os
from celery_outbox import caches
cache = caches.bounded_cache("test.fork", 8)
cache.put("parent's", 1)
pid = os.fork()
if pid == 0:
    os._exit(0 if cache.get("parent's") is None else 3)
_, status = os.waitpid(pid, 0)
assert cache.get("parent's") == 1
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_starts_with_empty_caches() -> None:
    done = subprocess.run([sys.executable, "-c", FORK], timeout=60, check=False)
    assert done.returncode == 0
