"""The loaded weights moved into 2 MiB pages, once, where they already are.

A decode step reads every weight once: hundreds of megabytes, in 4 KiB pages unless the system
puts anonymous memory in transparent huge pages by default (most set it to ``madvise``, and
neither torch nor oneDNN asks). Page walks then take about a tenth of a step
(docs/benchmarks.md, "Weights in huge pages"). Linux 6.1 and later moves memory in use into
huge pages in place (``madvise(MADV_COLLAPSE)``): the same bytes at the same addresses, so no
bit of any result changes.

:func:`collapse` does that after a load for the process's anonymous mappings that are almost
all resident (at least :data:`MIN_RESIDENT` of their pages: the weights, packed or not, and the
load's other allocations), whole aligned 2 MiB spans only, so nothing sparse is filled in. It
marks nothing for later (no ``MADV_HUGEPAGE``): memory allocated afterwards keeps the system's
setting, and the heap's trimming (:mod:`~prismgate.engines.malloc_trim`) works as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE = 2 << 20  # x86-64's and arm64's transparent huge page
MIN_RESIDENT = 0.9  # a mapping is collapsed when at least this fraction of it is in memory
MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1
SMAPS = Path("/proc/self/smaps")

Advise = Callable[[int, int, int], int]  # madvise(address, length, advice) -> 0, or -1 with errno set
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$")


@dataclass(frozen=True, slots=True)
class HugePages:
    """What :func:`collapse` did: bytes now in huge pages that were not (0: none), why, and how long it took."""

    bytes: int
    reason: str
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Mapping:
    """One anonymous, private, writable mapping of the process, from ``/proc/self/smaps``."""

    start: int
    end: int
    resident: int  # bytes in memory
    huge: int  # bytes of it already in huge pages

    @property
    def span(self) -> tuple[int, int]:
        """The whole 2 MiB pages inside it: ``(start, end)``, empty when there is none."""
        start = -(-self.start // HUGE_PAGE) * HUGE_PAGE
        return start, max(start, self.end // HUGE_PAGE * HUGE_PAGE)


def mappings(smaps: str) -> Iterator[Mapping]:
    """The anonymous private writable mappings listed in ``smaps`` (the text of ``/proc/<pid>/smaps``)."""
    header: tuple[int, int] | None = None
    resident = huge = 0
    for line in smaps.splitlines():
        match = _HEADER.match(line)
        if match is not None:
            if header is not None:
                yield Mapping(*header, resident, huge)
            start, end, perms, inode, name = match.groups()
            anonymous = inode == "0" and (name == "" or name == "[heap]" or name.startswith("[anon:"))
            private_writable = perms.startswith("rw") and perms[3] == "p"
            header = (int(start, 16), int(end, 16)) if anonymous and private_writable else None
            resident = huge = 0
        elif line.startswith("Rss:"):
            resident = int(line.split()[1]) << 10
        elif line.startswith("AnonHugePages:"):
            huge = int(line.split()[1]) << 10
    if header is not None:
        yield Mapping(*header, resident, huge)


def dense(found: Iterator[Mapping], min_resident: float = MIN_RESIDENT) -> list[Mapping]:
    """The mappings worth collapsing: a whole huge page inside, mostly resident, not all huge already."""
    chosen = []
    for m in found:
        start, end = m.span
        if end > start and m.resident >= min_resident * (m.end - m.start) and m.huge < end - start:
            chosen.append(m)
    return chosen


def _madvise() -> Advise | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    advise = ctypes.CDLL(name, use_errno=True).madvise
    advise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advise.restype = ctypes.c_int
    return advise


def huge_bytes(smaps: str) -> int:
    """Bytes of anonymous memory in huge pages, by ``smaps``."""
    return sum(m.huge for m in mappings(smaps))


def collapse(
    *, enabled: bool = True, device: str = "cpu", advise: Advise | None = None, smaps: Path = SMAPS
) -> HugePages:
    """Move the process's dense anonymous memory into huge pages (see the module's docstring), when the
    weights are on the CPU (``device``: the type of the device they are on).

    Never raises: when nothing could be moved, :attr:`HugePages.reason` says why (the setting, weights
    elsewhere, a system without ``/proc`` or ``madvise``, a kernel older than 6.1 or without huge pages)."""
    if not enabled:
        return HugePages(0, "not collapsed: huge_pages = false")
    if device != "cpu":
        return HugePages(0, f"not collapsed: the weights are on {device}, not the CPU")
    advise = advise or _madvise()
    if advise is None or not smaps.exists():
        return HugePages(0, "not collapsed: this system has no /proc/self/smaps or madvise (Linux only)")
    began = time.perf_counter()
    before = smaps.read_text()
    failures: dict[int, int] = {}
    for m in dense(mappings(before)):
        start, end = m.span
        if advise(start, end - start, MADV_COLLAPSE) != 0:
            code = ctypes.get_errno()
            failures[code] = failures.get(code, 0) + 1
    moved = max(0, huge_bytes(smaps.read_text()) - huge_bytes(before))
    seconds = time.perf_counter() - began
    if moved == 0 and not failures:
        return HugePages(0, f"nothing to collapse: {huge_bytes(before) >> 20} MiB already in huge pages", seconds)
    common = max(failures, key=failures.__getitem__) if failures else 0
    why = os.strerror(common)
    if common == errno.EINVAL:
        why = "this kernel has no MADV_COLLAPSE (Linux 6.1+) or no huge pages"
    if moved == 0:
        return HugePages(0, f"not collapsed: madvise(MADV_COLLAPSE) failed: {why}", seconds)
    reason = f"{moved >> 20} MiB of weights and other loaded memory moved into 2 MiB pages in {seconds:.1f} s"
    if failures:
        reason += f" ({sum(failures.values())} mappings could not be moved: {why})"
    return HugePages(moved, reason, seconds)
