"""Logging set-up: plain lines for people, or one JSON object per line for machines.

Structured fields travel on the record (``extra={"session_id": ...}``): the JSON formatter emits
them as keys, the plain one appends ``key=value``; fields bound with :func:`log_context` join
every record logged inside that context. Prompt and output text are logged only when
``log_prompts`` is on (:func:`prompts_allowed`). With JSON logs the stream must hold nothing
else, or a log shipper drops lines, so :func:`_json_only` turns progress bars off, makes
``warnings`` records, and has transformers' and vLLM's loggers propagate to ours; either way the
libraries' noise a user cannot act on stays off the console (:func:`prismgate.quiet.quiet_libraries`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prismgate.quiet import quiet_libraries
from prismgate.settings import Settings

# LogRecord's own attributes are not fields; uvicorn adds a coloured copy of its message
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}
_STANDARD.add("color_message")
_CONTEXT: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("prismgate_log_context", default={})  # noqa: B039
_log_prompts = False


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record carries (everything passed with ``extra=``)."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update(fields_of(record))
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``: the same fields as JSON, readable in a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = fields_of(record)
        if not extra:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback below the fields
        pairs = " ".join(f"{k}={_plain(v)}" for k, v in extra.items())
        return f"{head} {pairs}{sep}{tail}"


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() or c in '"=' for c in text)) else text


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (e.g. ``request_id=...``) to every record logged inside the block, in this task."""
    token = _CONTEXT.set({**_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def context_field(name: str) -> Any:
    """A field bound by an enclosing :func:`log_context`, or None."""
    return _CONTEXT.get().get(name)


def prompts_allowed() -> bool:
    """Whether prompt and output text may be logged (the setting ``log_prompts``)."""
    return _log_prompts


def configure(settings: Settings) -> None:
    global _log_prompts
    _log_prompts = settings.observability.log_prompts
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if settings.observability.log_json else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.observability.log_level.upper())
    quiet_libraries(debug=settings.observability.log_level.upper() == "DEBUG")
    if settings.observability.log_json:
        _json_only()


def _json_only() -> None:
    """Keep non-JSON text off the log stream: library logs and warnings through our handler."""
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # read when vLLM is first imported
    logging.captureWarnings(True)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency; vLLM-only images have it too
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
