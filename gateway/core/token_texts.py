"""A token's text and raw bytes, as OpenAI logprobs show them.

OpenAI logprobs carry each token as a string *and* as its UTF-8 ``bytes``, because
one token may hold half a character: the string is then lossy and only the bytes
are true. The core Tokenizer contract gives a token's text; for the common
byte-level BPE tokenizers (GPT-2 style, which SmolLM2 and the test model use) and
SentencePiece byte-fallback tokens (``<0xE2>``) the exact bytes are recovered from
the vocabulary entry, otherwise they are the UTF-8 of the text.

It lives in the core because recovering the bytes reads the Hugging Face tokenizer
behind the :class:`~prismgate.core.engine.Tokenizer` contract; codecs ask
:meth:`SessionService.token_texts` instead.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from prismgate.core.engine import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    """Per-model cache of token id -> (text, bytes); both are asked for every logprob entry."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        hf: Any = getattr(tokenizer, "hf", None)
        self._hf = hf
        self._byte_level = False
        self._specials: set[str] = set()
        if hf is not None:
            try:
                decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
                self._byte_level = "ByteLevel" in json.dumps(decoder)
                self._specials = set(hf.all_special_tokens)
            except Exception:  # not a fast tokenizer: fall back to text
                self._hf = None

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.token_text(token_id)
            hit = (text, list(self._bytes(token_id, text)))
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = hit
        return hit

    def _bytes(self, token_id: int, text: str) -> bytes:
        if self._hf is not None:
            piece = self._hf.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece not in self._specials:
                fallback = _BYTE_FALLBACK.match(piece)
                if fallback:
                    return bytes([int(fallback.group(1), 16)])
                if self._byte_level:
                    table = _byte_decoder()
                    if all(c in table for c in piece):
                        return bytes(table[c] for c in piece)
        return text.encode("utf-8")
