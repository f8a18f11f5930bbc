"""Fewer malloc arenas: memory a request freed is memory the next request can use.

glibc keeps what a thread freed in that thread's arena, and the gateway builds large answers
in worker threads, so the process grows by the fragments each burst leaves in some arena.
Two arenas is what ``MALLOC_ARENA_MAX=2`` sets, the usual advice for threaded Python servers;
an operator's own ``MALLOC_ARENA_MAX`` wins. Elsewhere than glibc this does nothing
(docs/architecture.md, "The memory budget").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter number
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas for this process (threads made later use them); True when it took effect."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc: no mallopt, or no such parameter
        log.debug("malloc arenas left as they are (no glibc mallopt)")
        return False
