"""One streaming generation per protocol, timed from the request leaving to each token arriving.

Every client sends the same raw token prompt (the tiny byte-level tokenizer makes ASCII text
and token ids interchangeable, so text protocols send the same prompt as text with the chat
template off) and decodes greedily. Times are client-side and include the client library's
own work (protobuf, JSON, flatbuffers decoding): that is what an application sees.

GraphPipe has no streaming: its "first token" is the whole response.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

STRUCT = "type.googleapis.com/google.protobuf.Struct"


@dataclass
class StreamResult:
    ttft_s: float
    token_times: list[float] = field(default_factory=list)  # seconds after send, one per generated token
    tokens: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    usage_tokens: int | None = None  # the answer's length as the server's own usage counted it; None: none sent

    @property
    def total_s(self) -> float:
        return self.token_times[-1] if self.token_times else self.ttft_s

    @property
    def per_token_s(self) -> float:
        """Mean gap between tokens after the first (NaN with fewer than two tokens)."""
        if self.tokens < 2 or len(self.token_times) < 2:
            return float("nan")
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)


Client = Callable[[Sequence[int], int], Awaitable[StreamResult]]


def inproc(service: Any) -> Client:
    """SessionService directly, on the server's own loop: the no-wire baseline."""
    from prismgate.core.actions import GenerateAction, GenerateSpec
    from prismgate.core.events import TokenEvent

    async def run(prompt: Sequence[int], max_tokens: int) -> StreamResult:
        action = GenerateAction(
            append_tokens=tuple(prompt), spec=GenerateSpec(max_tokens=max_tokens, temperature=0.0), origin="bench"
        )
        t0 = time.perf_counter()
        times: list[float] = []
        async for event in service.run(action):
            if isinstance(event, TokenEvent) and not event.is_prefill:
                times.append(time.perf_counter() - t0)
        return StreamResult(times[0] if times else float("nan"), times, len(times))

    return run


class Salience:
    """Salience gRPC: OpenSession (untimed), Generate (timed), CloseSession."""

    def __init__(
        self,
        target: str,
        model: str,
        readout_ranges: Callable[[int, int], Sequence[tuple[int, int]]] | None = None,
        channels: int = 1,
    ) -> None:
        """``readout_ranges(prompt_len, max_tokens)``: the [start, end) positions to ask readouts for;
        ``channels``: connections to spread the generations over (each its own TCP connection, so
        that several front-end processes, ``--workers``, all get some)."""
        import itertools

        import grpc

        from prismgate.schemas import salience_pb2, salience_pb2_grpc

        self.pb = salience_pb2
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, not one shared
        self.channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(max(1, channels))]
        self.channel = self.channels[0]
        self._stubs = itertools.cycle([salience_pb2_grpc.SalienceStub(c) for c in self.channels])
        self.stub = salience_pb2_grpc.SalienceStub(self.channel)
        self.model = model
        self.readout_ranges = readout_ranges

    async def __call__(self, prompt: Sequence[int], max_tokens: int) -> StreamResult:
        pb = self.pb
        stub = next(self._stubs)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(model=self.model))).session_id
        request = pb.GenerateRequest(session_id=sid, offset=0, append_tokens=prompt, max_tokens=max_tokens, top_k=1)
        if self.readout_ranges is not None:
            for start, end in self.readout_ranges(len(prompt), max_tokens):
                request.readout_ranges.add(start=start, end=end)
        t0 = time.perf_counter()
        times: list[float] = []
        received = 0
        done: Any = None  # the stream's GenerateDone
        try:
            async for event in stub.Generate(request):
                received += event.ByteSize()
                if event.HasField("token") and not event.token.is_prefill:
                    times.append(time.perf_counter() - t0)
                elif event.HasField("done"):
                    done = event.done
        finally:
            await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        return StreamResult(
            times[0] if times else float("nan"),
            times,
            len(times),
            request.ByteSize(),
            received,
            done.completion_tokens if done is not None else None,
        )

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def evergreen(ws_url: str, decode: Callable[[Sequence[int]], str], readouts: dict[str, Any] | None = None) -> Client:
    """Evergreen over WebSocket, JSON text frames: one connection (session) per generation.

    ``readouts``: ask for the ``readouts`` output, with these extra config fields
    (``{}``: the default text form; ``{"readoutEncodingFormat": "base64"}``, say).
    """
    import base64

    import websockets

    async def run(prompt: Sequence[int], max_tokens: int) -> StreamResult:
        text = decode(prompt)
        message = json.dumps(
            {
                "actions": [
                    {
                        "name": "GENERATE",
                        "inputs": [{"name": "prompt", "id": "p"}],
                        "outputs": [{"name": "response", "id": "r"}, {"name": "usage", "id": "u"}]
                        + ([{"name": "readouts", "id": "ro"}] if readouts is not None else []),
                        "configs": [
                            {
                                "@type": STRUCT,
                                "value": {
                                    "maxTokens": max_tokens,
                                    "temperature": 0,
                                    "chatTemplate": False,
                                    **(readouts or {}),
                                },
                            }
                        ],
                    }
                ],
                "nodeFragments": [
                    {
                        "id": "p",
                        "chunkFragment": {
                            "metadata": {"mimetype": "text/plain"},
                            "data": base64.b64encode(text.encode()).decode(),
                        },
                    }
                ],
            }
        )
        async with websockets.connect(ws_url + "/evergreen", max_size=None, compression=None) as ws:
            t0 = time.perf_counter()
            await ws.send(message)
            times: list[float] = []
            received = 0
            usage: dict[str, Any] | None = None
            while usage is None:
                frame = await ws.recv()
                now = time.perf_counter() - t0
                received += len(frame)
                for f in json.loads(frame).get("nodeFragments", []):
                    chunk = f.get("chunkFragment", {})
                    if f["id"] == "r" and chunk.get("data"):
                        times.append(now)
                    elif f["id"] == "u" and chunk.get("data"):
                        usage = json.loads(base64.b64decode(chunk["data"]))
        tokens = int(usage["completionTokens"])
        return StreamResult(times[0] if times else float("nan"), times, tokens, len(message), received, tokens)

    return run


def graphpipe(http_url: str) -> Client:
    """GraphPipe: one flatbuffer POST with a ``tokens`` row, ``tokens`` out (not streamed)."""
    import httpx
    import numpy as np
    from graphpipe import convert

    client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256))

    async def run(prompt: Sequence[int], max_tokens: int) -> StreamResult:
        body = bytes(
            convert.serialize_infer_request(
                convert.InferReq(
                    json.dumps({"max_tokens": max_tokens, "temperature": 0, "chat_template": False}),
                    [np.array([list(prompt)], dtype=np.int64)],
                    ["tokens"],
                    ["tokens", "lengths"],
                )
            )
        )
        t0 = time.perf_counter()
        response = await client.post(http_url + "/graphpipe", content=body)
        elapsed = time.perf_counter() - t0
        outputs, errors = convert.deserialize_infer_response(response.content)
        if errors:
            raise RuntimeError(f"graphpipe error: {errors}")
        tokens = int(outputs[1][0])
        # not streamed: every token arrives with the response (no per-token latency to speak of)
        return StreamResult(elapsed, [elapsed], tokens, len(body), len(response.content))

    run.client = client  # type: ignore[attr-defined]
    return run


def openai_sse(http_url: str, model: str, extra: dict[str, Any] | None = None) -> Client:
    """OpenAI ``/v1/completions`` with ``stream: true`` (Server-Sent Events), a token-id prompt.

    ``extra``: more request fields (prismgate's ``"readouts": true``, say). Tokens: the stream's
    ``usage`` (``completion_tokens``, also in ``usage_tokens``), else the chunks that carried text.
    """
    import httpx

    client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256))

    async def run(prompt: Sequence[int], max_tokens: int) -> StreamResult:
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        raw = json.dumps(body).encode()
        times: list[float] = []
        received = 0
        usage: int | None = None
        t0 = time.perf_counter()
        async with client.stream(
            "POST", http_url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
        ) as response:
            if response.status_code != 200:
                raise RuntimeError(f"openai status {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                received += len(line) + 1
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter() - t0)
                if chunk.get("usage"):
                    usage = int(chunk["usage"]["completion_tokens"])
        tokens = len(times) if usage is None else usage
        return StreamResult(times[0] if times else float("nan"), times, tokens, len(raw), received, usage)

    run.client = client  # type: ignore[attr-defined]
    return run


# -- raw clients: the cheapest load a Python process can put on the server ------------------------

READ_PAUSE_S = 0.005  # the raw clients' read clock: each connection reads at most once a tick


class _Ticker:
    """One clock per event loop for the raw clients: a connection that has read stops reading
    until the next tick, when every stopped one resumes at once; so the loop wakes about once a
    tick for all of them (not once per connection per write), and each read takes whatever
    the server wrote meanwhile (the server's writes do not change: they land in the socket's
    buffer). The client's CPU per token falls with the wake-ups and reads it saves."""

    _loops: ClassVar[dict[asyncio.AbstractEventLoop, _Ticker]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop, period: float) -> None:
        self.stopped: list[asyncio.Transport] = []
        self.period = period
        self.task = loop.create_task(self._run())

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, period: float) -> _Ticker:
        ticker = cls._loops.get(loop)
        if ticker is None or ticker.task.done():
            for old in [other for other in cls._loops if other.is_closed()]:
                del cls._loops[old]
            ticker = cls._loops[loop] = cls(loop, period)
        return ticker

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            stopped, self.stopped = self.stopped, []
            for transport in stopped:
                if not transport.is_closing():
                    transport.resume_reading()


class _Counting(asyncio.Protocol):
    """One connection: writes ``request`` (and ``then`` once the reply's head has come: the
    WebSocket message after the handshake), counts ``needle`` in every byte read (no parsing),
    notes when ``end`` has passed; on ``end`` it writes ``goodbye`` and closes (when given:
    WebSocket), else waits for the server to close (HTTP/1.1 ``Connection: close``). After each
    read it stops reading until ``ticker``'s next tick (:class:`_Ticker`).
    """

    def __init__(
        self,
        request: bytes,
        then: bytes | None,
        needle: bytes,
        end: bytes,
        goodbye: bytes | None,
        done: asyncio.Future[None],
        ticker: _Ticker,
    ) -> None:
        self.request, self.then, self.needle, self.end = request, then, needle, end
        self.goodbye, self.done, self.ticker = goodbye, done, ticker
        self.keep = max(len(needle), len(end)) - 1
        self.tail = b""
        self.count = 0
        self.received = 0
        self.ended = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        self.received += len(data)
        buf = self.tail + data
        if self.then is not None and b"\r\n\r\n" in buf:
            transport.write(self.then)
            self.then = None
        # occurrences wholly inside the tail were counted with the previous read
        self.count += buf.count(self.needle) - self.tail.count(self.needle)
        self.tail = buf[-self.keep :]
        if self.ended:
            return  # the rest (the server's close): read at once
        if self.end in buf:
            self.ended = True
            if self.goodbye is not None:
                transport.write(self.goodbye)
                transport.close()
        else:
            transport.pause_reading()
            self.ticker.stopped.append(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _counted(
    address: tuple[str, int], request: bytes, then: bytes | None, needle: bytes, end: bytes, goodbye: bytes | None
) -> _Counting:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    ticker = _Ticker.of(loop, READ_PAUSE_S)
    transport, protocol = await loop.create_connection(
        lambda: _Counting(request, then, needle, end, goodbye, done, ticker), *address
    )
    try:
        await done
    finally:
        transport.close()
    if not protocol.ended:
        raise RuntimeError(f"the stream ended before {end!r} ({protocol.received} bytes)")
    return protocol


def _address(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def openai_raw(http_url: str, model: str, extra: dict[str, Any] | None = None) -> Client:
    """OpenAI ``/v1/completions`` streamed, over a bare socket: HTTP/1.1 with ``Connection: close``
    (a connection per generation), the reply's ``data: `` lines counted in the bytes read.

    Tokens: the ``data: `` events less two (the closing chunk with ``finish_reason`` and
    ``[DONE]``), so one event per token (true of the null engine's one character per token;
    bench/overhead.py checks it on a warm-up generation). No ``token_times``: nothing per token.
    """
    import functools

    host, port = address = _address(http_url)

    @functools.cache
    def request(prompt: tuple[int, ...], max_tokens: int) -> bytes:
        fields = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "stream": True}
        body = json.dumps(fields | (extra or {})).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        return head.encode() + body

    async def run(prompt: Sequence[int], max_tokens: int) -> StreamResult:
        raw = request(tuple(prompt), max_tokens)
        t0 = time.perf_counter()
        counted = await _counted(address, raw, None, b"data: ", b"data: [DONE]", None)
        elapsed = time.perf_counter() - t0
        return StreamResult(float("nan"), [elapsed], counted.count - 2, len(raw), counted.received)

    return run


def _ws_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """A client WebSocket frame, FIN set, masked with the all-zero key (valid, and the payload
    goes out as it is: nothing to XOR)."""
    n = len(payload)
    if n < 126:
        header = bytes([0x80 | opcode, 0x80 | n])
    elif n < 1 << 16:
        header = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return header + b"\0\0\0\0" + payload


def evergreen_raw(
    ws_url: str, decode: Callable[[Sequence[int]], str], readouts: dict[str, Any] | None = None
) -> Client:
    """Evergreen over a bare socket: the WebSocket handshake, then (once the 101 has come) one
    GENERATE frame; the server's frames are never parsed: the response's fragments
    (``{"id": "r"``) are counted in the bytes read, and the usage fragment (``{"id": "u"``)
    ends the stream (a close frame, then the socket closed). Tokens: the ``r`` fragments less
    one (the last, which only closes the output). A connection per generation, as
    :func:`evergreen`.
    """
    import base64
    import functools

    host, port = address = _address(ws_url)
    handshake = (
        f"GET /evergreen HTTP/1.1\r\nhost: {host}:{port}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        "sec-websocket-key: cHJpc21nYXRlLWJlbmNoIQ==\r\nsec-websocket-version: 13\r\n\r\n"
    ).encode()
    goodbye = _ws_frame((1000).to_bytes(2, "big"), opcode=0x8)

    @functools.cache
    def frame(prompt: tuple[int, ...], max_tokens: int) -> bytes:
        outputs = [{"name": "response", "id": "r"}, {"name": "usage", "id": "u"}]
        if readouts is not None:
            outputs.append({"name": "readouts", "id": "ro"})
        config = {"maxTokens": max_tokens, "temperature": 0, "chatTemplate": False, **(readouts or {})}
        data = base64.b64encode(decode(prompt).encode()).decode()
        message = {
            "actions": [
                {
                    "name": "GENERATE",
                    "inputs": [{"name": "prompt", "id": "p"}],
                    "outputs": outputs,
                    "configs": [{"@type": STRUCT, "value": config}],
                }
            ],
            "nodeFragments": [{"id": "p", "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "data": data}}],
        }
        return _ws_frame(json.dumps(message).encode())

    async def run(prompt: Sequence[int], max_tokens: int) -> StreamResult:
        message = frame(tuple(prompt), max_tokens)
        t0 = time.perf_counter()
        counted = await _counted(address, handshake, message, b'{"id": "r"', b'{"id": "u"', goodbye)
        elapsed = time.perf_counter() - t0
        return StreamResult(float("nan"), [elapsed], counted.count - 1, len(handshake) + len(message), counted.received)

    return run
