"""The Tokenizer contract on top of a Hugging Face tokenizer (shared by every engine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prismgate.core.engine import ChatMessage
from prismgate.core.errors import invalid


class HFTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.hf.decode([token_id], skip_special_tokens=False))

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
        if self.hf.chat_template is None:
            raise invalid("this model has no chat template; send raw tokens or turn the chat template off")
        ids = self.hf.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
