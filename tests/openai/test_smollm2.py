"""The real default model (SmolLM2-135M-Instruct) behind the OpenAI API: a two-turn session."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import run_server


@pytest.mark.slow
def test_smollm2_session_chat_through_the_openai_client() -> None:
    from prismgate.settings import Settings

    settings = Settings.load(
        {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "threads": 1, "shutdown_grace_s": 2.0}, env={}
    )
    with run_server(settings) as server:
        model = server.service.pool.default_model
        sid = httpx.post(server.http_url + "/v1/sessions", json={"model": model}).json()["id"]
        with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            first = c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=24,
                temperature=0,
                extra_body={"session_id": sid},
            )
            assert "Paris" in (first.choices[0].message.content or "")
            second = c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "And of Italy? One word."}],
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"session_id": sid, "readouts": True},
            )
            chunks = list(second)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert "Rome" in text
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        # the first turn (its prompt, with the template's default system prompt, and its answer) was not recomputed
        assert (
            usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
        )
        readouts = [
            e
            for ch in chunks
            if ch.choices and ch.choices[0].model_extra.get("prismgate")
            for e in ch.choices[0].model_extra["prismgate"]["readouts"]
        ]
        axes = chunks[0].model_extra["prismgate"]["readouts"]
        assert readouts and len(readouts[0]["values"]) == len(axes["layers"])
        assert len(readouts[0]["values"][0]) == len(axes["concepts"])
