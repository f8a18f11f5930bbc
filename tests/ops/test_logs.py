"""Structured logs: one JSON line per finished generation, with ids, and no prompt text unless allowed."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

from prismgate.logs import JSONFormatter, TextFormatter, _ContextFilter, log_context
from tests.ops.helpers import action, collect

SECRET = "zebra-quartz-mango"


@contextlib.contextmanager
def json_logs() -> Iterator[io.StringIO]:
    """Everything logged anywhere, as the JSON formatter writes it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JSONFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def generation_lines(out: io.StringIO) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    return [d for d in lines if d["logger"] == "prismgate.generation"]


def test_one_json_line_per_generation_without_prompt_text(live_server: Any) -> None:
    service = live_server.service
    prompt = service.info().tokenizer.encode(SECRET)
    session = live_server.call(service.open(service.pool.default_model))
    with json_logs() as out:
        _, done = live_server.call(
            collect(service.generate(session.id, action(prompt, max_tokens=5, ignore_eos=True, origin="ops-logs")))
        )
    live_server.call(service.close(session.id))
    assert SECRET not in out.getvalue()
    (line,) = generation_lines(out)
    assert line["message"] == "generation finished" and line["level"] == "info"
    assert line["protocol"] == "ops-logs" and line["model"] == service.pool.default_model
    assert line["session_id"] == session.id
    assert len(line["request_id"]) == 32
    assert line["prompt_tokens"] == done.prompt_tokens == len(prompt)
    assert line["completion_tokens"] == done.completion_tokens == 5
    assert line["cached_tokens"] == done.cached_tokens
    assert line["finish_reason"] == "length"
    assert 0 < line["ttft_s"] <= line["duration_s"]
    assert "prompt_text" not in line and "output_text" not in line


def test_prompt_text_only_when_allowed(server_factory: Any) -> None:
    with server_factory(log_prompts=True) as server:
        prompt = server.service.info().tokenizer.encode(SECRET)
        with json_logs() as out:
            server.call(collect(server.service.run(action(prompt, max_tokens=2, origin="ops-logs"))))
    (line,) = generation_lines(out)
    assert line["prompt_text"] == SECRET
    assert isinstance(line["output_text"], str)


def test_failed_generation_logs_code_and_ids(live_server: Any) -> None:
    with json_logs() as out, contextlib.suppress(Exception):
        live_server.call(collect(live_server.service.generate("gone", action([1], origin="ops-logs"))))
    (line,) = generation_lines(out)
    assert line["message"] == "generation failed"
    assert line["code"] == "NOT_FOUND" and line["session_id"] == "gone" and line["protocol"] == "ops-logs"
    assert "model" not in line  # the session, and so its model, was never found


def test_bound_request_id_is_used(live_server: Any) -> None:
    """A codec that has its own request id (a header, say) binds it; the generation line carries it."""

    async def run() -> None:
        with log_context(request_id="req-from-codec"):
            await collect(live_server.service.run(action([1, 2, 3], max_tokens=1, origin="ops-logs")))

    with json_logs() as out:
        live_server.call(run())
    (line,) = generation_lines(out)
    assert line["request_id"] == "req-from-codec"


def test_text_formatter_appends_fields() -> None:
    record = logging.LogRecord("prismgate.x", logging.INFO, __file__, 1, "generation finished", (), None)
    record.session_id = "abc"
    record.ttft_s = 0.123456
    record.error = "two words"
    line = TextFormatter().format(record)
    assert line.endswith('prismgate.x: generation finished session_id=abc ttft_s=0.1235 error="two words"')


def test_json_formatter_keeps_context_fields() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JSONFormatter())
    handler.addFilter(_ContextFilter())
    logger = logging.getLogger("prismgate.ops-test")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with log_context(request_id="r1", session_id="s1"):
            logger.warning("inside", extra={"session_id": "explicit"})
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    inside, outside = (json.loads(line) for line in out.getvalue().splitlines())
    assert inside["request_id"] == "r1" and inside["session_id"] == "explicit" and inside["level"] == "warning"
    assert "request_id" not in outside
