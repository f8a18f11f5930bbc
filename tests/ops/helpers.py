"""Small helpers for the ops tests: scrape a live server, drive the core on its loop."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.events import Done, TokenEvent
from tests.serve_process import Served, serve_process


def scrape(http_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics over HTTP and parse it with Prometheus's own text parser: {(sample name, labels): value}."""
    response = httpx.get(f"{http_url}/metrics", timeout=10)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum over ``name``'s series that carry ``labels`` (PromQL's ``sum(name{labels})``), 0 when none do."""
    wanted = set(labels.items())
    return sum(v for (sample, have), v in samples.items() if sample == name and wanted <= set(have))


def action(
    tokens: list[int], *, max_tokens: int = 8, origin: str = "ops-test", readouts: bool = False, **spec: Any
) -> GenerateAction:
    ranges = (PositionRange(0, len(tokens) + max_tokens),) if readouts else ()
    return GenerateAction(
        append_tokens=tuple(tokens),
        spec=GenerateSpec(max_tokens=max_tokens, readout_ranges=ranges, **spec),
        origin=origin,
    )


async def collect(stream: Any) -> tuple[list[TokenEvent], Done]:
    events: list[TokenEvent] = []
    async for event in stream:
        if isinstance(event, Done):
            return events, event
        events.append(event)
    raise AssertionError("stream ended without Done")


# -- the real command in a process of its own -----------------------------------------------------


def serve(
    tmp_path: Path, model_dir: Path, *args: str, fd_limit: int | None = None
) -> contextlib.AbstractContextManager[Served]:
    """``prismgate serve`` on the tiny model in a process of its own (``fd_limit``: its RLIMIT_NOFILE)."""
    model = ("--model", str(model_dir), "--model-name", "tiny-llama", "--concept-pack", "none")
    return serve_process(tmp_path, *model, *args, timeout=120.0, fd_limit=fd_limit)
