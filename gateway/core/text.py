"""Token ids to text while streaming: UTF-8 safe, stop-string aware.

Tokens do not align with characters (a byte-level BPE token can hold half of an
emoji), so text is released only once it decodes cleanly; and text that could be
the start of a stop string is held back until it is known not to be one. Stop strings
match only in the text of tokens after the first ``min_tokens`` (vLLM's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_strings: Sequence[str] = (),
        *,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self._decode = decode
        self._min_tokens = min_tokens  # stop strings are looked for once more tokens than this are in
        self._include_stop = include_stop  # a matched stop string stays at the end of the text
        self._ids: list[int] = []
        self._prefix = 0  # ids before this index are already released as text
        self._text = ""  # decoded text not yet released
        self._stops = tuple(stop_strings)
        self.stopped_on: str | None = None

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to show (maybe empty)."""
        if self.stopped_on is not None:
            return ""
        self._ids.append(token_id)
        # Decode with a little context before the new ids: some tokenizers drop a
        # leading space when a token is decoded on its own.
        context = max(0, self._prefix - 4)
        before = self._decode(self._ids[context : self._prefix])
        window = self._decode(self._ids[context:])
        if window.endswith(REPLACEMENT):
            return ""  # an incomplete character: wait for the next token
        self._text += window[len(before) :]
        self._prefix = len(self._ids)
        return self._release()

    def flush(self) -> str:
        """End of stream: release whatever is held (a stop string that never completed)."""
        if self.stopped_on is None and self._prefix < len(self._ids):
            context = max(0, self._prefix - 4)
            before = self._decode(self._ids[context : self._prefix])
            self._text += self._decode(self._ids[context:])[len(before) :]
            self._prefix = len(self._ids)
        out, self._text = self._text, ""
        return out

    def _release(self) -> str:
        if len(self._ids) <= self._min_tokens:
            out, self._text = self._text, ""
            return out
        for stop in self._stops:
            at = self._text.find(stop)
            if at >= 0:
                out = self._text[: at + len(stop) if self._include_stop else at]
                self._text = ""
                self.stopped_on = stop
                return out
        hold = self._longest_stop_prefix_suffix()
        cut = len(self._text) - hold
        out, self._text = self._text[:cut], self._text[cut:]
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:n]):
                    best = n
                    break
        return best
