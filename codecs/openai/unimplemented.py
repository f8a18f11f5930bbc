"""Request fields this server does not implement: refused when they would change the output, else ignored.

The tables cover every field of vLLM's chat and completion requests (its
``vllm/entrypoints/openai/chat_completion/protocol.py`` and ``completion/protocol.py``) and
OpenAI's own that prismgate does not implement. A refused field is accepted only when it asks
for nothing (absent, ``null``, empty, or the value that means "as without it"); anything else
is a 400 naming it. An ignored field does not change the tokens or text a client gets.
A name in no table is unknown: ignored, as OpenAI does, and logged once per name per process.
docs/openai.md lists every field with what happens to it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from prismgate.codecs.openai.errors import bad_request

log = logging.getLogger(__name__)

MAX_LOGGED_NAMES = 1024  # unknown field names remembered (and logged) per process; a client picks them
MAX_NAME_CHARS = 64  # an unknown name is logged cut to this many characters

# field -> the values that ask for nothing (besides null and an empty array, object or string)
_REFUSED_BOTH: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "watermarking": (False,),
    "length_penalty": (1, 1.0),
    "skip_special_tokens": (True,),  # special tokens are always left out of the text here
    "truncate_prompt_tokens": (),
    "truncation_side": (),
    "prompt_logprobs": (),
    "logprob_token_ids": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "vllm_xargs": (),
    "repetition_detection": (),
    "thinking_token_budget": (-1,),
}
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    **_REFUSED_BOTH,
    "functions": (),
    "function_call": ("none", "auto"),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "include_reasoning": (True,),
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "documents": (),
    "chat_template": (),
    "chat_template_kwargs": (),
    "media_io_kwargs": (),
    "mm_processor_kwargs": (),
    "return_prompt_text": (False,),
    "web_search_options": (),
    "verbosity": (),
}
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {
    **_REFUSED_BOTH,
    "prompt_embeds": (),
    "add_special_tokens": (False,),  # the prompt's tokens are exactly its text's; send special tokens in it
}

# fields that do not change the output: accepted and ignored
_IGNORED_BOTH = frozenset(
    {
        "user",
        "priority",  # vLLM's scheduling order; the admission queue here is fair per key instead
        "request_id",
        "cache_salt",  # prefix caches here are per session, never shared between clients' requests
        "kv_transfer_params",
        "ec_transfer_params",
        "stream_interval",
        "routed_experts_prompt_start",
        "return_token_offsets",
        "return_mm_kwargs",
        "spaces_between_special_tokens",  # special tokens are always left out of the text
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
    }
)
CHAT_IGNORED = _IGNORED_BOTH
_EMPTY_ASKS = frozenset({"web_search_options"})  # an empty object turns the feature on
COMPLETION_IGNORED = _IGNORED_BOTH


class UnknownFields:
    """Logs each unknown field name once per process (the first ``MAX_LOGGED_NAMES`` of them)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._full = False
        self._lock = threading.Lock()

    def note(self, names: list[str], endpoint: str) -> None:
        with self._lock:
            fresh = [n for n in names if n not in self._seen]
            room = MAX_LOGGED_NAMES - len(self._seen)
            logged, dropped = fresh[:room], fresh[room:]
            self._seen.update(logged)
            full_now = bool(dropped) and not self._full
            self._full = self._full or bool(dropped)
        for name in logged:
            log.warning("%s: ignored the unknown request field %r", endpoint, name[:MAX_NAME_CHARS])
        if full_now:
            log.warning("%s: %d unknown field names logged; further ones are ignored unlogged", endpoint, room)


UNKNOWN = UnknownFields()


def check_fields(body: Mapping[str, Any], known: frozenset[str], *, chat: bool) -> None:
    """Refuse each unimplemented field that asks for something; log unknown names once."""
    refused = CHAT_REFUSED if chat else COMPLETION_REFUSED
    ignored = CHAT_IGNORED if chat else COMPLETION_IGNORED
    unknown: list[str] = []
    for name, value in body.items():
        if name in refused:
            if not _asks_nothing(value, refused[name]) or (name in _EMPTY_ASKS and value is not None):
                raise bad_request(f"'{name}' is not supported by this server (see docs/openai.md)", name)
        elif name not in known and name not in ignored:
            unknown.append(name)
    if unknown:
        UNKNOWN.note(unknown, "/v1/chat/completions" if chat else "/v1/completions")


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None or (isinstance(value, list | dict | str) and not value):
        return True
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)
