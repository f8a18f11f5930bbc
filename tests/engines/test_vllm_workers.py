"""``prismgate serve --engine vllm --workers 2``: vLLM's ``AsyncLLM`` in the engine host, two front-ends.

The vLLM engine's readouts come back over its side channel to the engine host, which hands
each request's events to the front-end that owns the request. These tests run the real
command (the tiny model, a random two-layer pack, vLLM's default compilation on CPU) and
check that routing where it could go wrong: eight streams with readouts on every token at once,
over fresh connections spread by the kernel over both front-ends, each getting its own
prompt's readouts (the same as the prompt alone), a session's turn on either front-end, and
SIGTERM draining both front-ends and the host to exit 0.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.engines.vllm_factory import require_vllm, use_cpu_env
from tests.serve_process import Served, serve_process
from tests.tiny_model import build_random_pack

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
MAX_TOKENS = 6
PROMPTS = [[10 + 7 * i + j for j in range(12 + 3 * i)] for i in range(8)]  # eight prompts, none alike


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    require_vllm()
    folder = tmp_path_factory.mktemp("vllm-workers")
    pack = build_random_pack(folder, tiny_model_dir, layers=(1, 2))
    use_cpu_env()
    args = (
        "--engine", "vllm", "--model", str(tiny_model_dir), "--model-name", MODEL, "--concept-pack", str(pack),
        "--dtype", "float32", "--vllm-block-size", "32", "--vllm-kv-cache-gb", "0.25", "--workers", "2",
    )  # fmt: skip
    with serve_process(folder, *args, timeout=600.0, stop=signal.SIGTERM) as running:
        yield running


def streamed(url: str, prompt: list[int], **extra: Any) -> tuple[str, list[int], list[list[list[float]]]]:
    """One streamed completion on a fresh connection: (the front-end that answered, token ids, readouts)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "readouts": True, **extra}
    ids: list[int] = []
    values: list[list[list[float]]] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        worker = reply.headers["prismgate-worker"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                for entry in (choice.get("prismgate") or {}).get("readouts", []):
                    ids.append(entry["id"])
                    values.append(entry["values"])
    return worker, ids, values


def test_each_front_end_gets_its_own_requests_readouts(served: Served) -> None:
    alone = [streamed(served.http_url, prompt) for prompt in PROMPTS]
    for _, ids, values in alone:
        assert len(ids) == MAX_TOKENS and len(values) == MAX_TOKENS
        assert np.asarray(values).shape == (MAX_TOKENS, 2, 3)  # the random pack's two layers and three concepts
    for _ in range(3):  # eight at once, three times: the kernel spreads the connections over both front-ends
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: streamed(served.http_url, p), PROMPTS))
        workers = {worker for worker, _, _ in together}
        for (_, ids, values), (_, ids_alone, values_alone) in zip(together, alone, strict=True):
            assert ids == ids_alone
            # float32 on vLLM's CPU kernels: a batch moves values by rounding, another prompt's by whole units
            np.testing.assert_allclose(values, values_alone, rtol=1e-4, atol=1e-4)
        if workers == {"0", "1"}:
            return
    pytest.fail(f"every request went to front-end {workers}: the routing across front-ends was not exercised")


def test_a_session_turn_on_either_front_end(served: Served) -> None:
    opened = httpx.post(f"{served.http_url}/v1/sessions", json={}, timeout=30)
    assert opened.status_code == 200, opened.text
    session = opened.json()["id"]
    seen: set[str] = set()
    length = 0
    for turn in range(8):  # fresh connections until both front-ends have served a turn of the session
        worker, ids, values = streamed(served.http_url, PROMPTS[turn][:5], session_id=session)
        assert len(ids) == len(values) == MAX_TOKENS
        seen.add(worker)
        length += 5 + MAX_TOKENS
        dumped = httpx.get(f"{served.http_url}/v1/sessions/{session}", timeout=30)
        assert dumped.status_code == 200, dumped.text
        assert dumped.json()["length"] == length  # every turn's tokens, whichever front-end took it
        if seen == {"0", "1"}:
            return
    pytest.fail(f"eight turns all went to front-end {seen}")


def test_sigterm_stops_both_front_ends_and_the_host_with_exit_0(served: Served) -> None:
    # Last in this module: it stops the module's server.
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=120) == 0, served.log_path.read_text()[-3000:]
    messages = [line["message"] for line in served.logs()]
    assert messages.count("drained") == 2 and "engine host stopped" in messages
