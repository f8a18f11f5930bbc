"""How an aborted Evergreen session tells the client why (the spec defines no error message).

WebSocket: the server closes the socket with the close code of the error's code from the
gateway's one table (:func:`prismgate.codecs.status.close_code`: ``4000 + HTTP status``)
and a reason ``"<CODE_NAME>: <message>"``; the message names the offending node or
action. WebSocket close reasons hold at most 123 bytes, so longer reasons are cut at a
character boundary and end with "...".
gRPC: the stream ends with the error's own status code and the full message as details.
"""

from __future__ import annotations

from prismgate.core.errors import GatewayError

MAX_REASON_BYTES = 123


def close_reason(error: GatewayError) -> str:
    text = f"{error.code.name}: {error.message}"
    raw = text.encode()
    if len(raw) <= MAX_REASON_BYTES:
        return text
    cut = raw[: MAX_REASON_BYTES - 3].decode("utf-8", errors="ignore")
    return cut + "..."
