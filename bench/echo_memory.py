"""RSS of the gateway while bench/hostile.py row 10's echoes run, without the probe and the normal client.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.echo_memory 8 [1 3 ...]

The embedded SmolLM2 with row 10's settings (the default memory budget, ``max_active`` 3). For
each count N given, N echoes at once from a process of their own (3,516-token prompt, top-20
logprobs, readouts); the gateway's RSS and the budget's bytes held are sampled every 50 ms.
Prints, per count: the statuses, how long they took, the RSS before, its peak growth and what
stayed 2 s after, and the most the budget held.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

from bench.hostile import _ECHO_CLIENTS, gateway, model_of
from tests.reliability.conftest import rss_mb


def _watch(memory: Any, peak: list[float], stop: threading.Event) -> None:
    """Keep the peak RSS (MB) and budget bytes held (MiB) in ``peak`` until ``stop``."""
    while not stop.is_set():
        peak[0] = max(peak[0], rss_mb())
        peak[1] = max(peak[1], memory.used / 2**20)
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    counts = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [8]
    with gateway("smollm2") as server:
        body = {"model": model_of(server), "prompt": [5 + i % 200 for i in range(3516)], "max_tokens": 16}
        body |= {"echo": True, "logprobs": 20, "readouts": True}
        memory = server.service.pool.memory
        print(f"memory budget {memory.limit / 2**20:.0f} MiB", flush=True)
        for n in counts:
            time.sleep(2)
            idle = rss_mb()
            peak = [idle, 0.0]
            stop = threading.Event()
            watcher = threading.Thread(target=_watch, args=(memory, peak, stop))
            watcher.start()
            clients = _ECHO_CLIENTS.replace("range(8)", f"range({n})").replace("Executor(8)", f"Executor({n})")
            started = time.perf_counter()
            argv_ = [sys.executable, "-c", clients, server.http_url + "/v1/completions", json.dumps(body)]
            done = subprocess.run(argv_, capture_output=True, text=True, timeout=2400, check=False)
            took = time.perf_counter() - started
            stop.set()
            watcher.join()
            time.sleep(2)
            statuses = done.stdout.strip() or done.stderr[-300:]
            print(
                f"{n} echoes: {statuses} in {took:.0f} s; RSS {idle:.0f} MB idle, peak +{peak[0] - idle:.0f} MB, "
                f"after +{rss_mb() - idle:.0f} MB; the budget held at most {peak[1]:.0f} MiB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
