"""The loaded weights moved into huge pages (engines/huge_pages.py): where they are, with the same bytes.

The move is the kernel's (``MADV_COLLAPSE``), so these tests check what is ours: which mappings
are chosen, that a dense one really ends up in huge pages with its bytes unchanged, that a
model's results keep every bit across the move, and that the engine says what it did.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from prismgate.engines.huge_pages import HUGE_PAGE, SMAPS, Mapping, collapse, dense, mappings

MiB = 1 << 20

SMAPS_TEXT = """\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
Rss:               10240 kB
AnonHugePages:         0 kB
7f0000a00000-7f0001400000 rw-p 00000000 00:00 0
Rss:                1024 kB
AnonHugePages:         0 kB
7f0001400000-7f0001e00000 rw-s 00000000 00:00 0
Rss:               10240 kB
7f0001e00000-7f0002800000 r--p 00000000 08:01 42                         /usr/lib/libtorch.so
Rss:               10240 kB
7f0002800000-7f0003200000 r--p 00000000 00:00 0
Rss:               10240 kB
55d000000000-55d000a00000 rw-p 00000000 00:00 0                          [heap]
Rss:               10240 kB
AnonHugePages:     10240 kB
55d000a00000-55d000b00000 rw-p 00000000 00:00 0                          [anon: glibc: malloc arena]
Rss:                1024 kB
AnonHugePages:         0 kB
7f0003201000-7f0003c01000 rw-p 00000000 00:00 0                          [anon: glibc: malloc arena]
Rss:               10240 kB
AnonHugePages:         0 kB
7ffd00000000-7ffd00a00000 rw-p 00000000 00:00 0                          [stack]
Rss:               10240 kB
"""


def test_only_dense_private_anonymous_mappings_with_a_whole_huge_page_are_chosen() -> None:
    found = list(mappings(SMAPS_TEXT))
    # shared memory, a library's file, a read-only mapping and the stack are not anonymous private writable memory
    assert [m.start for m in found] == [0x7F0000000000, 0x7F0000A00000, 0x55D000000000, 0x55D000A00000, 0x7F0003201000]
    chosen = dense(iter(found))
    # the sparse one (1 of 10 MiB), the heap already in huge pages and the 1 MiB arena are left alone
    assert [m.start for m in chosen] == [0x7F0000000000, 0x7F0003201000]
    assert chosen[0].span == (0x7F0000000000, 0x7F0000A00000)
    # an unaligned mapping: only its whole 2 MiB pages, never past its ends
    assert chosen[1].span == (0x7F0003400000, 0x7F0003C00000)
    assert Mapping(0x1000, 0x200000, 0x1FF000, 0).span == (0x200000, 0x200000)  # no whole page inside


def _mapping_of(address: int) -> Mapping:
    return next(m for m in mappings(SMAPS.read_text()) if m.start <= address < m.end)


def test_a_dense_mapping_moves_into_huge_pages_with_its_bytes() -> None:
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps: not Linux")
    size = 8 * MiB + HUGE_PAGE  # at least four whole aligned huge pages inside, wherever it lands
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        content = os.urandom(size)
        memory[:] = content  # every page resident
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        if _mapping_of(address).huge:
            pytest.skip("this system puts anonymous memory in huge pages already (transparent_hugepage=always)")
        done = collapse()
        if done.reason.startswith("not collapsed: madvise"):
            pytest.skip(done.reason)  # a kernel older than 6.1, or without huge pages
        assert _mapping_of(address).huge >= 8 * MiB, done
        assert done.bytes >= 8 * MiB and done.reason.startswith(f"{done.bytes >> 20} MiB of weights"), done
        assert memory[:] == content  # the same bytes at the same address
    finally:
        memory.close()


def test_the_setting_and_a_refusing_kernel_are_reported_not_raised(tmp_path: Path) -> None:
    assert collapse(enabled=False).reason == "not collapsed: huge_pages = false"
    assert collapse(device="cuda").reason == "not collapsed: the weights are on cuda, not the CPU"
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS_TEXT)
    calls = []

    def refuse(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        ctypes.set_errno(errno.EINVAL)
        return -1

    refused = collapse(advise=refuse, smaps=smaps)
    assert calls == [(0x7F0000000000, 10 * MiB, 25), (0x7F0003400000, 8 * MiB, 25)]
    assert refused.bytes == 0
    assert refused.reason == (
        "not collapsed: madvise(MADV_COLLAPSE) failed: this kernel has no MADV_COLLAPSE (Linux 6.1+) or no huge pages"
    )
    assert collapse(advise=lambda *_: 0, smaps=tmp_path / "absent").reason.startswith("not collapsed: this system")


# in a process of its own: what the test process holds is in huge pages already (every engine moves it)
BITS_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from prismgate.engines.hf.loading import load
from prismgate.engines.huge_pages import collapse
torch.set_num_threads(1)
loaded = load(Path(sys.argv[1]), model_id="m", concept_pack=None, device="cpu", dtype="bfloat16",
              max_model_len=None, huge_pages=False)
adapter = loaded.adapter

def logits():
    with torch.inference_mode():
        cache = adapter.new_cache()
        first = adapter.forward(list(range(3, 40)), cache, 0, [], [], [36])
        steps = [adapter.decode_batch([7 + i], [cache], [37 + i]) for i in range(4)]
        return torch.cat([first.reshape(-1)] + [s.reshape(-1) for s in steps])

before = logits()
moved = collapse()
print(json.dumps({"reason": loaded.info.huge_pages_reason, "moved": moved.bytes, "why": moved.reason,
                  "equal": bool(torch.equal(before, logits()))}))
"""


def test_a_model_gives_the_same_bits_after_the_move(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", BITS_SCRIPT, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reason"] == "not collapsed: huge_pages = false"
    if result["why"].startswith("not collapsed: madvise"):
        pytest.skip(result["why"])  # a kernel older than 6.1, or without huge pages
    assert result["moved"] > 0, result  # the load's memory did move
    assert result["equal"], result


def test_readyz_says_how_much_moved_into_huge_pages(live_server: Any) -> None:
    pages = httpx.get(f"{live_server.http_url}/readyz", timeout=30).json()["huge_pages"]
    if pages["bytes"] > 0:
        assert pages["reason"].startswith(f"{pages['bytes'] >> 20} MiB of weights and other loaded memory"), pages
    else:
        assert pages["reason"].startswith(("not collapsed: ", "nothing to collapse: ")), pages
