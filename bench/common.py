"""What every benchmark shares: a gateway in a background thread, models, timing, results.

The machines these run on are noisy, so each benchmark measures the things it compares
side by side in one process and one run, interleaved, and reports ratios. Absolute
numbers are printed too, but only the ratios mean something across runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from prismgate.thread_server import RunningGateway, serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "build" / "bench"  # models built for the benchmarks (git-ignored)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

T = TypeVar("T")


# -- models -----------------------------------------------------------------------------


def tiny_model(max_len: int = 512) -> tuple[Path, Path]:
    """The tiny random Llama of the tests (built once per ``max_len``) and a random concept pack."""
    from tests.tiny_model import build_random_pack, build_tiny_llama

    folder = WORK / f"tiny-llama-{max_len}"
    model_dir = folder / "tiny-llama"
    if not (model_dir / "config.json").exists():
        build_tiny_llama(model_dir, max_len=max_len)
    pack = folder / "tiny-pack.safetensors"
    if not pack.exists():
        build_random_pack(folder, model_dir)
    return model_dir, pack


def settings(**values: Any) -> Any:
    """Settings for an in-process gateway on free loopback ports (environment ignored)."""
    from prismgate.settings import Settings

    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "http_port": 0,
        "grpc_port": 0,
        "shutdown_grace_s": 1.0,
        "threads": 1,
        "max_active": 256,
    }
    base.update(values)
    return Settings.load(base, env={})


def model_settings(name: str) -> Any:
    """Settings serving a benchmark model by name: ``tiny`` (the tests' random Llama and pack) or
    ``smollm2`` (the embedded default and its pack). ValueError for any other name."""
    if name == "tiny":
        model_dir, pack = tiny_model(512)
        return settings(model=str(model_dir), model_name="tiny-llama", concept_pack=str(pack))
    if name == "smollm2":
        return settings()
    raise ValueError(f"unknown model {name!r} (tiny, smollm2)")


# -- a real gateway in a background thread ------------------------------------------------


Server = RunningGateway  # a started gateway on its own thread (prismgate.thread_server)


def serve(config: Any, engine: Any = None) -> contextlib.AbstractContextManager[Server]:
    """Start ``prismgate.server.Gateway`` on free ports around ``engine`` (None: from settings)."""
    return serve_in_thread(config, engine=engine, ready_timeout=600)


# -- measuring -----------------------------------------------------------------------------


class CpuMeter:
    """Process CPU seconds, split into the calling (client) thread and everything else.

    The clients run on the main thread; the gateway runs on its own thread (plus gRPC's
    C-core threads), so ``server_s`` is process CPU minus the main thread's: an estimate
    of what the gateway spent, with gRPC client-side polling counted on the server side.
    """

    def __enter__(self) -> CpuMeter:
        self._p0 = time.process_time()
        self._t0 = time.thread_time()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.process_s = time.process_time() - self._p0
        self.client_s = time.thread_time() - self._t0
        self.server_s = max(self.process_s - self.client_s, 1e-9)
        self.wall_s = time.perf_counter() - self._w0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float], spec: str = ".2f") -> str:
    """``median (lowest-highest)``, each formatted by ``spec`` (a format spec such as ``".2f"``)."""
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size from /proc (Linux)."""
    with open(f"/proc/{pid or os.getpid()}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- reporting ------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv,
    }


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table; floats get 3 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if v != v else f"{v:.3g}"
        if isinstance(v, list) and all(isinstance(x, float) for x in v):
            return "-".join(cell(x) for x in v)  # a spread: lowest-highest
        return str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def default_model(dtype: str = "auto", **options: Any) -> Any:
    """The embedded default model (SmolLM2) loaded on the CPU as the transformers engine loads it,
    without a concept pack; ``options`` are more keyword arguments of ``loading.load``."""
    from prismgate.engines.hf.loading import load
    from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path

    return load(
        default_model_path(),
        model_id=DEFAULT_MODEL_ID,
        concept_pack=None,
        device="cpu",
        dtype=dtype,
        max_model_len=None,
        **options,
    )


def prefill(adapter: Any, ids: Sequence[int], chunk: int = 512) -> Any:
    """A new KV cache holding ``ids``, fed to the adapter in ``chunk``-token forwards."""
    cache = adapter.new_cache()
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        adapter.forward(part, cache, start, [], [], [len(part) - 1])
    return cache


def decode_step(adapter: Any, merged: Any, caches: Sequence[Any], ids: Sequence[int], position: int) -> Any:
    """One decode step of ``len(caches)`` rows, each at ``position``: a row alone through the adapter, as the
    engine steps it, several through ``merged`` (a :class:`~prismgate.engines.hf.batch_cache.BatchCache`)."""
    if len(caches) == 1:
        return adapter.forward(ids, caches[0], position, [], [], [0])
    return merged.step(ids, caches, [position] * len(caches))


def decode_seconds(adapter: Any, caches: Sequence[Any], position: int, steps: int) -> float:
    """Median seconds of a decode step of a row per cache, the first at ``position`` (``steps`` timed
    steps through one merged cache kept from step to step, as the engine keeps it; the first step,
    which merges, untimed)."""
    from prismgate.engines.hf.batch_cache import BatchCache

    merged = BatchCache(adapter)
    rows = len(caches)
    times = []
    for step in range(steps + 1):
        started = time.perf_counter()
        decode_step(adapter, merged, caches, [100 + step + row for row in range(rows)], position + step)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
