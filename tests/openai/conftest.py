"""Fixtures for the OpenAI API tests: the official client pointed at a live gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import LONG_CONTEXT, TINY_MODEL_ID, LiveServer, run_server, tiny_settings
from tests.tiny_model import build_random_pack

__all__ = ["LONG_CONTEXT"]
EOS_FREE = 300  # the long prompt's greedy answer runs at least this long without EOS


@pytest.fixture(scope="session")
def client(live_server: Any) -> Iterator[openai.OpenAI]:
    """The official client, unchanged; no retries so that error statuses surface at once."""
    with openai.OpenAI(base_url=live_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def model() -> str:
    return TINY_MODEL_ID


@pytest.fixture(scope="session")
def long_prompt(client: openai.OpenAI, model: str) -> str:
    """A prompt the tiny random model answers greedily for 200 tokens without emitting EOS."""
    for i in range(40):
        prompt = f"Tell me a long story, number {i}."
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0
        )
        if r.choices[0].finish_reason == "length":
            return prompt
    pytest.fail("no prompt found that runs 200 tokens without EOS: the fixture needs other prompts")


@pytest.fixture(scope="module")
def long_model(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The 4k-context, EOS-free tiny model (tests/conftest.py), so that a generation runs for seconds.

    The session-wide tiny model decodes its whole 512-token context in well under a
    second, too fast to disconnect from in the middle reliably.
    """
    return long_model_dir, build_random_pack(tmp_path_factory.mktemp("openai-long-pack"), long_model_dir)


@pytest.fixture(scope="module")
def long_server(long_model: tuple[Path, Path]) -> Iterator[LiveServer]:
    with run_server(tiny_settings(*long_model)) as server:
        yield server


@pytest.fixture(scope="module")
def long_client(long_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=long_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def eos_free_prompt(long_client: openai.OpenAI, model: str) -> str:
    """A prompt whose greedy answer on ``long_server`` runs EOS_FREE tokens without EOS."""
    for i in range(40):
        prompt = f"Tell me a very long story, number {i}."
        r = long_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=EOS_FREE, temperature=0
        )
        if r.choices[0].finish_reason == "length":
            return prompt
    pytest.fail(f"no prompt found that runs {EOS_FREE} tokens without EOS: the fixture needs other prompts")
