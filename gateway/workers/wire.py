"""The typed link between our own processes: msgpack frames of tagged structs over a Unix socket.

A frame is a 4-byte big-endian length and a msgpack array of messages: everything a
process has to say in one event-loop tick goes out in one frame and one ``write``, so a
host streaming 256 generations sends one frame per engine step, not one per token.

Each message is a :class:`msgspec.Struct` tagged with its :class:`Kind`; what it carries
(requests, events, sessions, keys) is decoded against the core's dataclasses, so a frame
that does not match its schema is refused whole. Numpy arrays (readouts, features) cross
as a msgpack extension holding their dtype, shape and raw bytes, checked on arrival. No
pickle: a frame can hold data, never code. docs/architecture.md has the message table.
"""

from __future__ import annotations

import asyncio
import enum
import math
import socket
import struct
from typing import Any, get_origin

import msgspec
import numpy as np

from prismgate.core.engine import EngineInfo, EngineRequest, ReadoutManifest, VisionTokens
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, TokenEvent
from prismgate.core.fairness import Share
from prismgate.core.features import FeatureManifest
from prismgate.core.health import Health
from prismgate.core.session import Session
from prismgate.engines.tokenizer import tokenizer_path

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30
ARRAY_EXT = 1  # the msgpack extension code of a numpy array
ARRAY_DTYPES = frozenset({"<f4", "<f2", "<f8", "<i8", "<i4", "|u1", "|b1"})


class Kind(enum.Enum):
    """What a message is; its value is the tag that leads the message on the wire."""

    JOIN = "join"
    READY = "ready"
    HELLO = "hello"
    STATUS = "status"
    INFOS = "infos"
    GENERATE = "generate"
    CANCEL = "cancel"
    TOKEN = "token"
    DONE = "done"
    END = "end"
    CALL = "call"
    OK = "ok"
    ERROR = "error"
    EXIT = "exit"
    RELEASE = "release"


class Target(enum.Enum):
    """What a :class:`Call` runs on, in the host."""

    STORE = "store"
    QUOTA = "quota"
    ENGINE = "engine"


class LinkError(ConnectionError):
    """A frame that breaks the link's rules: the connection that sent it is dropped."""


class Status(msgspec.Struct, frozen=True):
    """What every front-end mirrors of the host: enough to answer /readyz, /metrics and the pool's questions."""

    health: dict[str, Health]
    in_flight: dict[str, int]
    active: int = 0
    queued: int = 0
    max_active: int = 0
    preemptions: int = 0
    recomputes: int = 0
    sessions: int = 0
    session_tokens: int = 0
    frontends: int = 0
    pid: int = 0


class ModelInfo(msgspec.Struct, frozen=True):
    """An :class:`EngineInfo` as it crosses: the tokenizer stays behind, named by the folder it loads from."""

    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_path: str
    readouts: ReadoutManifest | None = None
    vision: VisionTokens | None = None
    engine_name: str = ""
    steering: bool = False
    steering_gates: bool = False
    steering_off: str | None = None
    steering_features: bool = False
    deterministic: bool = False
    deterministic_off: str | None = None
    features: FeatureManifest | None = None
    kv_bytes_per_token: int = 0
    kv_block_tokens: int = 1
    dtype: str = ""
    dtype_reason: str = ""
    packed_layers: int = 0
    packed_reason: str = ""
    huge_page_bytes: int = 0
    huge_pages_reason: str = ""
    mixed_passes: bool = False
    mixed_passes_reason: str = ""


class WireError(msgspec.Struct, frozen=True):
    """A failure as data: a :class:`GatewayError` keeps its code, message and retry hint."""

    code: int
    message: str
    retry_after_s: float | None = None


class _Message(msgspec.Struct, frozen=True, tag_field="kind", array_like=True):
    pass


class Join(_Message, tag=Kind.JOIN.value, frozen=True):
    """A front-end's first message: it becomes a peer (status pushes, holds, leases). A side call sends none."""


class Ready(_Message, tag=Kind.READY.value, frozen=True):
    """A peer has loaded its tokenizers: from now on it counts among the host's ready front-ends."""


class Hello(_Message, tag=Kind.HELLO.value, frozen=True):
    models: list[str]
    holds_sessions: bool
    status: Status
    infos: dict[str, ModelInfo]


class StatusUpdate(_Message, tag=Kind.STATUS.value, frozen=True):
    status: Status


class Infos(_Message, tag=Kind.INFOS.value, frozen=True):
    infos: dict[str, ModelInfo]


class Generate(_Message, tag=Kind.GENERATE.value, frozen=True):
    call: int
    model: str
    request: EngineRequest
    share: Share


class Cancel(_Message, tag=Kind.CANCEL.value, frozen=True):
    call: int


class Token(_Message, tag=Kind.TOKEN.value, frozen=True):
    call: int
    event: TokenEvent


class Finished(_Message, tag=Kind.DONE.value, frozen=True):
    call: int
    event: Done


class End(_Message, tag=Kind.END.value, frozen=True):
    call: int


class Call(_Message, tag=Kind.CALL.value, frozen=True):
    """One call on the host's store, quota or engine; ``args`` are decoded by the method's own schema."""

    call: int
    target: Target
    method: str
    args: msgspec.Raw


class Ok(_Message, tag=Kind.OK.value, frozen=True):
    """A call's answer; ``value`` is decoded by the caller, which knows the type it asked for."""

    call: int
    value: msgspec.Raw


class Error(_Message, tag=Kind.ERROR.value, frozen=True):
    call: int
    error: WireError


class Exit(_Message, tag=Kind.EXIT.value, frozen=True):
    """The end of a generation hold, with the session as the front-end's generation left it."""

    call: int
    session: Session | None


class Release(_Message, tag=Kind.RELEASE.value, frozen=True):
    session_key: str


Message = (
    Join
    | Ready
    | Hello
    | StatusUpdate
    | Infos
    | Generate
    | Cancel
    | Token
    | Finished
    | End
    | Call
    | Ok
    | Error
    | Exit
    | Release
)


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(ARRAY_EXT, msgspec.msgpack.encode((array.dtype.str, array.shape, array.data)))
    raise NotImplementedError(f"{type(obj).__name__} does not cross the process link")


def _array(code: int, data: memoryview) -> Any:
    if code != ARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, tuple[int, ...], bytes])
    if dtype not in ARRAY_DTYPES or any(n < 0 for n in shape):
        raise ValueError(f"array of dtype {dtype!r} and shape {shape}")
    if math.prod(shape) * np.dtype(dtype).itemsize != len(raw):
        raise ValueError(f"array of shape {shape} and {dtype} with {len(raw)} bytes")
    return np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _decode_hook(kind: type, obj: Any) -> Any:
    if (get_origin(kind) or kind) is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected {kind}, got {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
_FRAME = msgspec.msgpack.Decoder(list[Message], ext_hook=_array, dec_hook=_decode_hook)


def encode(value: Any) -> bytes:
    """``value`` as msgpack (a call's arguments or answer)."""
    return _ENCODER.encode(value)


def decode(raw: msgspec.Raw | bytes, kind: Any) -> Any:
    """A call's arguments or answer, checked against ``kind``; :class:`LinkError` when they do not match."""
    try:
        return msgspec.msgpack.decode(raw, type=kind, ext_hook=_array, dec_hook=_decode_hook)
    except (msgspec.DecodeError, ValueError, GatewayError) as exc:  # GatewayError: a dataclass's own check
        raise LinkError(f"malformed value: {exc}") from None


def frame(messages: list[Message]) -> bytes:
    """One frame: the length header and the messages."""
    body = _ENCODER.encode(messages)
    if len(body) > MAX_FRAME:
        raise LinkError(f"a frame of {len(body)} bytes is over the link's {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def unframe(size: int, body: bytes | None = None) -> list[Message]:
    """Check a frame's announced ``size`` (with ``body`` None) or decode its ``body``."""
    if size > MAX_FRAME:
        raise LinkError(f"a frame of {size} bytes is over the link's {MAX_FRAME}")
    if body is None:
        return []
    try:
        messages: list[Message] = _FRAME.decode(body)
    except (msgspec.DecodeError, ValueError, GatewayError) as exc:  # GatewayError: a dataclass's own check
        raise LinkError(f"malformed frame: {exc}") from None
    return messages


def pack_error(exc: BaseException) -> WireError:
    if isinstance(exc, GatewayError):
        return WireError(int(exc.code), exc.message, exc.retry_after_s)
    return WireError(int(Code.INTERNAL), f"engine host: {type(exc).__name__}: {exc}")


def unpack_error(packed: WireError) -> GatewayError:
    error = GatewayError(Code(packed.code), packed.message)
    error.retry_after_s = packed.retry_after_s
    return error


def model_info(info: EngineInfo) -> ModelInfo:
    """What crosses of an engine's info: every field but the tokenizer, which the front-end loads itself."""
    fields = {name: getattr(info, name) for name in ModelInfo.__struct_fields__ if name != "tokenizer_path"}
    return ModelInfo(tokenizer_path=tokenizer_path(info.tokenizer), **fields)


class Channel:
    """One end of a connection: :meth:`send` queues, the loop's next tick writes them all in one frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._pending: list[Message] = []
        self._scheduled = False
        self.closed = False

    def send(self, message: Message) -> None:
        if self.closed:
            return
        self._pending.append(message)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self.closed or not self._pending:
            return
        batch, self._pending = self._pending, []
        data = frame(batch)
        try:
            self.writer.write(data)
        except (ConnectionError, RuntimeError):
            self.closed = True

    async def drain(self) -> None:
        """Let the transport's buffer empty (back-pressure on a slow reader)."""
        if not self.closed:
            await self.writer.drain()

    async def receive(self) -> list[Message]:
        """The next frame's messages: ``asyncio.IncompleteReadError`` when the other end has gone,
        :class:`LinkError` for a frame over :data:`MAX_FRAME` or one that does not match its schema."""
        (size,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
        unframe(size)
        return unframe(size, await self.reader.readexactly(size))

    def close(self) -> None:
        self._flush()
        self.closed = True
        self.writer.close()


class BlockingChannel:
    """The same frames over a plain socket, for one call from a worker thread (it never waits on a loop)."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._file = self._sock.makefile("rb")

    def send(self, message: Message) -> None:
        self._sock.sendall(frame([message]))

    def receive(self) -> list[Message]:
        header = self._file.read(HEADER.size)
        if len(header) < HEADER.size:
            raise LinkError("the engine host closed the connection")
        (size,) = HEADER.unpack(header)
        unframe(size)
        body = self._file.read(size)
        if len(body) < size:
            raise LinkError("the engine host closed the connection")
        return unframe(size, body)

    def close(self) -> None:
        self._file.close()
        self._sock.close()
