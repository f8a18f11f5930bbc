"""Plots (bench/results/*.png) and the markdown section docs/benchmarks.md from the latest results.

    .venv/bin/python -m bench.report

Reads bench/results/{overhead,overhead_readouts,vs_vllm,vs_vllm_frontend,sessions,readouts,steering,
steering_vllm,features}.json
(whichever exist), draws one PNG per benchmark with matplotlib, and writes their sections of docs/benchmarks.md:
ratios first, since only ratios measured side by side in one run compare across these noisy machines. A section
(a ``### `` heading and what follows it) that this script writes replaces the section of the same heading;
the sections written by hand (runs on other machines, runs stopped early, their readings) stay as they are.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, table

DOC = ROOT / "docs" / "benchmarks.md"
VS_TITLE = "decode tokens/s per stream, ratio to vllm serve, by concurrency"
RO_TITLE = "decode tokens/s, ratio to readouts off"


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot_overhead(data: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    engines = sorted({r["engine"] for r in rows}, key=lambda e: e != "null")
    protocols = [p for p in ("salience", "evergreen", "graphpipe", "openai") if any(r["protocol"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(engines) + 1, figsize=(5 * (len(engines) + 1), 4))
    for ax, engine in zip(axes, engines, strict=False):
        for proto in protocols:
            pts = sorted(
                (r["streams"], r["ttft_ratio"]) for r in rows if r["engine"] == engine and r["protocol"] == proto
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=proto)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"TTFT / in-process TTFT ({engine} engine)")
        ax.set_xlabel("concurrent streams")
        ax.axhline(1, color="grey", lw=0.5)
        ax.legend()
    ax = axes[-1]
    top = max(r["streams"] for r in rows)
    null = [r for r in rows if r["engine"] == "null" and r["streams"] == top]
    ax.bar([r["protocol"] for r in null], [r["tokens_per_cpu_s"] for r in null])
    ax.set_yscale("log")
    ax.set_title(f"null engine: tokens per gateway CPU-second ({top} streams)")
    fig.tight_layout()
    out = RESULTS / "overhead.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_sessions(data: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    labels = [f"{r['context'] // 1024}K" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, title) in zip(
        axes,
        (
            ("bytes_sent", "request bytes per turn"),
            ("prefilled", "tokens prefilled per turn"),
            ("turn_ms", "turn latency (ms)"),
        ),
        strict=True,
    ):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[f"session_{key}"] for r in rows], width=0.4, label="session (deltas)")
        ax.bar([i + 0.2 for i in x], [r[f"resend_{key}"] for r in rows], width=0.4, label="resend whole")
        ax.set_xticks(list(x), labels)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("conversation length")
        ax.legend()
    fig.tight_layout()
    out = RESULTS / "sessions.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_bars(data: dict[str, Any], name: str, group: str, label: str, value: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    groups = list(dict.fromkeys(r[group] for r in rows))
    labels = list(dict.fromkeys(r[label] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        ys = [next((r[value] for r in rows if r[group] == g and r[label] == lab), 0) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], ys, width=width, label=str(lab))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [str(g) for g in groups])
    ax.axhline(1, color="grey", lw=0.5)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out = RESULTS / f"{name}.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


VS_COLUMNS = (
    "server",
    "streams",
    "tokens_each",
    "ttft_ms",
    "decode_tokens_per_s",
    "frontend_cpu_ms_per_token",
    "ttft_ratio",
    "decode_rate_ratio",
    "frontend_cpu_ratio",
)


def vs_vllm_section(vs: dict[str, Any], name: str, where: str) -> list[str]:
    """``bench/vs_vllm.py``'s results (``bench/gpu_check.py`` writes the GPU ones)."""
    return [
        f"### Against `vllm serve` as it ships ({where})",
        "",
        f"vLLM {vs['vllm']}, {Path(vs['model']).name}, {vs['settings']}, {vs['max_tokens']} tokens per",
        "generation, greedy, OpenAI streaming. `vllm serve` runs with vLLM's defaults (torch.compile; CUDA graphs",
        "on GPUs), `--enforce-eager` beside it; prismgate runs `prismgate serve --engine vllm` with its defaults",
        "(the same compilation) and the concept pack loaded, readouts off, on every generated token, or at 4",
        "positions. All servers up at once, a round of each target back to back, order rotating; figures are",
        "medians, each ratio the median of round-by-round ratios to `vllm serve`'s round of the same rep.",
        "`frontend_cpu_ms_per_token`: CPU time of the API-server process alone (vLLM's engine core and",
        "workers excluded) per streamed token. Targets: decode >= 0.97 off, >= 0.95 on every token, TTFT <= 1.05.",
        *([machine_load(vs["load_average"])] if "load_average" in vs else []),
        *(
            [
                "On the shared 2-core CPU machine the ratios of one build move by about 0.1 from run to run;",
                "docs/vllm.md lists five runs side by side. A GPU run of `bench/gpu_check.py` measures the GPU case.",
            ]
            if where == "CPU"
            else []
        ),
        "",
        f"![{name}]({rel(plot_bars(vs, name, 'streams', 'server', 'decode_rate_ratio', VS_TITLE))})",
        "",
        table(vs["rows"], VS_COLUMNS),
        "",
    ]


FRONTEND_COLUMNS = ("streams", "vllm serve", "readouts off", "readouts every token", "off / vllm", "every / vllm")


def frontend_section(after: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    """``bench/vs_vllm.py --frontend-only``: front-end CPU per streamed token, this build (and an earlier one)."""

    def rows(vs: dict[str, Any], build: str) -> list[dict[str, Any]]:
        out = []
        for streams in sorted({r["streams"] for r in vs["rows"]}):
            at = {r["server"]: r for r in vs["rows"] if r["streams"] == streams}
            off = at["prismgate, readouts off (OpenAI SSE)"]
            every = at["prismgate, readouts every token (OpenAI SSE)"]
            out.append(
                {
                    "build": build,
                    "streams": streams,
                    "vllm serve": at["vllm serve"]["frontend_cpu_ms_per_token"],
                    "readouts off": off["frontend_cpu_ms_per_token"],
                    "readouts every token": every["frontend_cpu_ms_per_token"],
                    "off / vllm": off["frontend_cpu_ratio"],
                    "every / vllm": every["frontend_cpu_ratio"],
                }
            )
        return out

    table_rows = rows(before, before.get("build") or "before") if before else []
    table_rows += rows(after, after.get("build") or "now")
    return [
        "### Front-end CPU per streamed token, against `vllm serve`'s API server (CPU)",
        "",
        "`bench/vs_vllm.py --frontend-only`: `vllm serve` (its defaults) and `prismgate serve --engine vllm`, same",
        f"model, OpenAI SSE `/v1/completions`, greedy, {after['max_tokens']} tokens per generation, {after['reps']}",
        "rounds per target alternating. Milliseconds of CPU of the API-server process alone (engine core and",
        "workers excluded, read from `/proc` per thread in nanoseconds) per streamed token, median over rounds;",
        "the ratios are medians of each round's ratio to `vllm serve`'s round of the same rep. Readouts every",
        "token: the default pack's 8 layers x 8 concepts on every chunk, work `vllm serve` does not do.",
        *([machine_load(after["load_average"])] if "load_average" in after else []),
        "",
        table(table_rows, ("build", *FRONTEND_COLUMNS)),
        "",
    ]


CORES_FOR = 20_000  # tokens/s of an engine the front-end must keep up with (a GPU serving an 8B model)


def readout_wire_section(after: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    """``bench/overhead.py --readouts``: front-end CPU per streamed token, readouts on every token vs off."""

    def spread(r: dict[str, Any], key: str, low: str, high: str, digits: int) -> str:
        return f"{r[key]:.{digits}f} ({r[low]:.{digits}f}-{r[high]:.{digits}f})"

    earlier = {(r["streams"], r["protocol"], r["readouts"]): r for r in (before or {}).get("rows", [])}
    rows = []
    for r in after["rows"]:
        b = earlier.get((r["streams"], r["protocol"], r["readouts"]))
        rows.append(
            {
                "streams": r["streams"],
                "protocol": r["protocol"],
                "readouts": r["readouts"],
                "bytes_per_token": f"{r['bytes_per_token']:.0f}",
                "before: us/token": spread(b, "cpu_us_per_token", "cpu_us_low", "cpu_us_high", 0) if b else "",
                "before: ratio to off": spread(b, "ratio_to_off", "ratio_low", "ratio_high", 2) if b else "",
                "after: us/token": spread(r, "cpu_us_per_token", "cpu_us_low", "cpu_us_high", 0),
                "after: ratio to off": spread(r, "ratio_to_off", "ratio_low", "ratio_high", 2),
                "after: tokens/s": f"{r['tokens_per_s']:.3g}",
                f"after: cores for {CORES_FOR:,} tokens/s": f"{CORES_FOR / r['tokens_per_cpu_s']:.1f}",
            }
        )
    build = f" of {before['build']}" if before and "build" in before else ""

    def ranges(data: dict[str, Any] | None) -> str:
        found: dict[tuple[str, str], list[float]] = {}
        for r in (data or {}).get("rows", []):
            if r["readouts"] != "off":
                found.setdefault((r["protocol"], r["readouts"]), []).append(r["ratio_to_off"])
        return "; ".join(f"{p} {m} {min(v):.2f}-{max(v):.2f}" for (p, m), v in found.items())

    return [
        "### Readouts on the wire: front-end CPU per streamed token",
        "",
        "`.venv/bin/python -m bench.overhead --readouts off,every,base64 --concurrency 32,64,256 "
        f"--reps {after['reps']} --streams-per-cell {after['streams_per_cell']} --max-tokens {after['max_tokens']}`:",
        "one gateway process on the null engine with an 8 x 8 readout (the default pack's 64 values, random",
        "full-length float32s) on every generated token, readouts off beside it. Every (protocol, readouts)",
        f"cell runs once per round, the order rotating, {after['reps']} rounds; CPU of the gateway (the process",
        "less the client thread) per streamed token, median (lowest-highest) over rounds, and the median",
        "(lowest-highest) of each round's ratio to the same round's `off`. `every`: JSON numbers (Salience:",
        "protobuf floats); `base64`: `encoding_format: base64` (OpenAI), `readoutEncodingFormat: base64`",
        "(Evergreen). Before: the same command with `--readouts off,every --results overhead_readouts_before`,",
        f"run just before on `codecs/` and `schemas/`{build} (the benchmark and the rest as they are now).",
        *([machine_load(after["load_average"])] if "load_average" in after else []),
        *(
            ["Before: " + machine_load(before["load_average"])[0].lower() + machine_load(before["load_average"])[1:]]
            if before and "load_average" in before
            else []
        ),
        "The machine is shared (other jobs ran beside both runs), so compare the ratios, each measured within one run.",
        "",
        table(rows, list(rows[0])),
        "",
        f"`tokens/s`: tokens the gateway streamed per second of wall time (its clients, in the same process,\n"
        f"share the 2 cores); `cores for {CORES_FOR:,} tokens/s`: {CORES_FOR:,} over the tokens streamed per\n"
        "gateway CPU-second, the front-end cores an engine of that throughput would keep busy if front-end\n"
        "processes scaled linearly (one process measured here; two processes: the next section). Salience's\n"
        "CPU includes the gRPC client's own C threads (they run in the gateway's process), so it reads high.",
        "",
        "Median ratios to off over the concurrencies, "
        + (f"before: {ranges(before)}; " if before else "")
        + f"after: {ranges(after)}.",
        "",
    ]


def steering_section(data: dict[str, Any], engine: str) -> list[str]:
    compiled = " (its default compiled path, steering inside the graph)" if engine == "vLLM" else ""
    return [
        f"### Steering, {engine} engine",
        "",
        f"`bench/steering.py`: the {engine} engine{compiled} in-process, a batch of {data['batch']} greedy",
        f"requests decoding together, {data['max_tokens']} tokens each, {data['reps']} rounds per mode, modes",
        "interleaved: no request steered (`off`), every request steered with one concept vector at a middle",
        "pack layer (`all`), every other request steered (`mixed`). Ratios are medians of each round's ratio",
        "to the `off` round beside it; `tokens_per_cpu_s` counts the CPU of the process and its children.",
        *([machine_load(data["load_average"])] if "load_average" in data else []),
        "",
        table(data["rows"], list(data["rows"][0])),
        "",
    ]


def features_section(data: dict[str, Any]) -> list[str]:
    """bench/features.py's runs: one table, each engine at one and at four SAE layers."""
    parts = [
        "### SAE features",
        "",
        f"`bench/features.py`: each engine in-process on SmolLM2-135M-Instruct, the top {data['top_k']} SAE features",
        "of every generated token at one layer (the shipped SAE, layer 15) and at four (that one and three",
        "random SAEs of its shape at layers 5, 10 and 20, written for the run: a cost needs shapes, not trained",
        "features), against none; batches of 1, 4 and 8 greedy requests, with and without features interleaved",
        "round by round, median tokens/s over the rounds. The transformers engine runs the model's dtype on 2",
        "threads, the vLLM engine float32 compiled on 1 (as its tests do). Target: a ratio >= 0.95 at one layer.",
        "Each run's machine load is given where it was recorded: on a shared 2-core machine the ratios are rough,",
        "and a ratio above 1 is noise.",
        "",
    ]
    for run in data["runs"]:
        load = run.get("load_average")
        where = f" (load {load[0]:.1f} -> {load[1]:.1f})" if load else ""
        parts.append(
            f"* {run['engine']} on {run.get('device', 'cpu')}, {run['layers']} layer(s): {run['rounds']} rounds of"
            f" {run['tokens']} tokens{where}" + (f"; {run['note']}" if run.get("note") else "")
        )
    rows = [{"device": run.get("device", "cpu"), **r} for run in data["runs"] for r in run["rows"]]
    parts += ["", table(rows, list(dict.fromkeys(k for r in rows for k in r))), ""]
    return parts


def sections(text: str) -> tuple[str, dict[str, str]]:
    """``text`` cut at its ``### `` headings: what comes before the first, and each section by its heading."""
    head, *rest = ("\n" + text).split("\n### ")
    return head.lstrip("\n"), {"### " + part.split("\n", 1)[0]: "### " + part.rstrip("\n") for part in rest}


def merge(old: str, new: str) -> str:
    """``old`` with each section of ``new`` in the place of its namesake (new sections at the end); the
    introduction is ``new``'s, and the sections only ``old`` has stay where they were."""
    head, written = sections(new)
    _, kept = sections(old)
    out = [head.rstrip("\n")]
    out += [written.pop(title, body) for title, body in kept.items()]
    out += list(written.values())
    return "\n\n".join(part.rstrip("\n") for part in out) + "\n"


def machine_load(load: list[float]) -> str:
    return f"Machine load (1-minute average): {load[0]:.1f} at the start of the measurements, {load[1]:.1f} at the end."


def rel(path: Path) -> str:
    return "../" + str(path.relative_to(ROOT))


def main() -> int:
    parts = [
        "## Benchmarks",
        "",
        "Measured with the commands in [`bench/`](../bench/README.md) (`make bench`, or `make bench-quick`).",
        "These machines are noisy and shared, so every benchmark runs what it compares side by side, interleaved,",
        "in one run, and the numbers to read are the **ratios**; absolute times only hold for that run.",
        "",
    ]
    overhead = load("overhead")
    if overhead:
        top = max(r["streams"] for r in overhead["rows"])
        ceiling = [r for r in overhead["rows"] if r["engine"] == "null" and r["streams"] == top]
        parts += [
            "### Gateway overhead per protocol",
            "",
            f"Same prompt, greedy, {overhead['max_tokens']} tokens per generation; `inproc` is `SessionService` driven",
            "on the gateway's own loop (no wire). `null` is an engine that makes tokens at no cost (the gateway's",
            "ceiling); `tiny` is the tests' tiny Llama on the transformers engine. Ratios are to `inproc` at the same",
            "concurrency. GraphPipe does not stream: its TTFT is the whole response. `tokens_per_cpu_s` is tokens per",
            "CPU-second the gateway process spent outside the client thread.",
            "",
            f"![overhead]({rel(plot_overhead(overhead))})",
            "",
            table(
                overhead["rows"],
                (
                    "engine",
                    "streams",
                    "protocol",
                    "ttft_ms",
                    "per_token_ms",
                    "tokens_per_s",
                    "tokens_per_cpu_s",
                    "ttft_ratio",
                    "per_token_ratio",
                    "throughput_ratio",
                ),
            ),
            "",
            f"Gateway ceiling ({top} streams, null engine), tokens per gateway CPU-second: "
            + ", ".join(f"{r['protocol']} {r['tokens_per_cpu_s']:.3g}" for r in ceiling)
            + ".",
            "",
        ]
    for name, where in (("vs_vllm", "CPU"), ("vs_vllm_gpu", "GPU")):
        vs = load(name)
        if vs:
            parts += vs_vllm_section(vs, name, where)
    frontend = load("vs_vllm_frontend")
    if frontend:
        parts += frontend_section(frontend, load("vs_vllm_frontend_before"))
    wire = load("overhead_readouts")
    if wire:
        parts += readout_wire_section(wire, load("overhead_readouts_before"))
    sessions = load("sessions")
    if sessions:
        parts += [
            "### Sessions: deltas vs resending the conversation",
            "",
            f"Salience gRPC, model `{sessions['model']}` (the tiny Llama built with a 20K context for all sizes),",
            f"{sessions['chunk']} user tokens and {sessions['answer']} answer tokens per turn; the row is the turn",
            "where the conversation passes that length. Bytes are protobuf payloads of the request.",
            "",
            f"![sessions]({rel(plot_sessions(sessions))})",
            "",
            table(
                sessions["rows"],
                (
                    "context",
                    "turn",
                    "session_bytes_sent",
                    "resend_bytes_sent",
                    "bytes_ratio",
                    "session_prefilled",
                    "resend_prefilled",
                    "prefill_ratio",
                    "session_turn_ms",
                    "resend_turn_ms",
                    "latency_ratio",
                ),
            ),
            "",
        ]
    readouts = load("readouts")
    if readouts:
        parts += [
            "### Readouts",
            "",
            f"Transformers engine in-process, {readouts['max_tokens']} greedy tokens per answer; decode tokens/s",
            "with readouts off, for every generated token, and for 4 positions. Ratios are to `off`.",
            "",
            f"![readouts]({rel(plot_bars(readouts, 'readouts', 'model', 'readouts', 'ratio_to_off', RO_TITLE))})",
            "",
            table(readouts["rows"], list(readouts["rows"][0])),
            "",
        ]
    for name, engine in (("steering", "transformers"), ("steering_vllm", "vLLM")):
        steering = load(name)
        if steering:
            parts += steering_section(steering, engine)
    features = load("features")
    if features:
        parts += features_section(features)
    DOC.write_text(merge(DOC.read_text() if DOC.exists() else "", "\n".join(parts)))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
