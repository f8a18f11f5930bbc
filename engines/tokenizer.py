"""The Tokenizer contract on top of a Hugging Face tokenizer (shared by every engine)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prismgate.core.engine import ChatMessage
from prismgate.core.errors import invalid


class HFTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self._backend = _plain_backend(tokenizer)
        # transformers passes ``split_special_tokens`` to the Rust tokenizer as a flag on the
        # shared object, set per call: calls from two threads at once must not interleave
        self._lock = threading.Lock()
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._specials = tuple(
            sorted({t.content for t in decoder.values() if getattr(t, "special", False) and t.content}, key=len)
        ) or tuple(getattr(tokenizer, "all_special_tokens", ()))

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Text as text (control-token strings in ordinary tokens), or with ``special`` as the model reads it."""
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def holds_special(self, text: str) -> bool:
        return any(s in text for s in self._specials)

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:  # streaming decodes twice per token: skip transformers' wrapping
            return str(self._backend.decode(list(ids), skip_special_tokens=True))
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.hf.decode([token_id], skip_special_tokens=False))

    @property
    def renders_tools(self) -> bool:
        """A template that reads the ``tools`` variable (Hermes, Qwen2.5, SmolLM3, Llama 3.1 ...)."""
        template = self.hf.chat_template
        return isinstance(template, str) and "tools" in template and "tool_call" in template

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        if self.hf.chat_template is None:
            raise invalid("this model has no chat template; send raw tokens or turn the chat template off")
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        with self._lock:  # the template's own control tokens are control tokens (the flag off)
            ids = self.hf.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True, **extra
            )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def _plain_backend(tokenizer: Any) -> Any:
    """The ``tokenizers`` object behind ``tokenizer`` when its ``decode`` adds nothing to that object's own.

    transformers' fast tokenizer decodes with its Rust backend, then cleans up spaces when
    ``clean_up_tokenization_spaces`` is set; a subclass may change either. Only the plain case
    is skipped over; anything else keeps ``tokenizer.decode``.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return tokenizer.backend_tokenizer
    return None


def load_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer a model folder holds, as an engine loads it (a front-end process loads its own)."""
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(path))


def tokenizer_path(tokenizer: object) -> str:
    """The folder ``tokenizer`` was loaded from; "" when it was not loaded from one."""
    return str(getattr(getattr(tokenizer, "hf", None), "name_or_path", "") or "")
