"""Chunk payloads: inline ``data``, or a ``ref`` URI fetched under the configured policy.

Supported refs: ``data:`` URIs always; ``file://`` only under ``evergreen_file_root``
(off by default: a gateway must not read its own disk for strangers); ``http(s)://`` only
with ``evergreen_http_refs`` on, fetched with httpx under a size and a time limit.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import httpx

from prismgate.core.errors import Code, GatewayError, exhausted, invalid, precondition
from prismgate.schemas import evergreen_pb2 as pb


@dataclass(frozen=True, slots=True)
class RefPolicy:
    file_root: str | None = None
    http: bool = False
    max_bytes: int = 16 * 1024 * 1024
    timeout_s: float = 10.0


async def payload(chunk: pb.Chunk, policy: RefPolicy, where: str) -> bytes:
    """The bytes of one chunk (empty for a chunk with neither data nor ref)."""
    kind = chunk.WhichOneof("payload")
    if kind == "data":
        return chunk.data
    if kind is None:
        return b""
    ref = chunk.ref
    scheme = ref.partition(":")[0].lower()
    if scheme == "data":
        return _data_uri(ref, where)
    if scheme == "file":
        return _file(ref, policy, where)
    if scheme in ("http", "https"):
        return await _http(ref, policy, where)
    raise invalid(f"{where}: ref scheme {scheme + ':'!r} is not supported (use data:, file: or http(s): refs)")


def _data_uri(ref: str, where: str) -> bytes:
    header, sep, body = ref[5:].partition(",")
    if not sep:
        raise invalid(f"{where}: malformed data: URI (no comma)")
    if header.split(";")[-1].strip().lower() == "base64":
        try:
            return base64.b64decode(urllib.parse.unquote(body), validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"{where}: data: URI is not valid base64") from None
    return urllib.parse.unquote_to_bytes(body)


def _file(ref: str, policy: RefPolicy, where: str) -> bytes:
    if policy.file_root is None:
        raise precondition(f"{where}: file: refs are disabled on this server (evergreen_file_root is unset)")
    parsed = urllib.parse.urlparse(ref)
    if parsed.netloc not in ("", "localhost"):
        raise invalid(f"{where}: file: ref names host {parsed.netloc!r}; only local files are read")
    name = urllib.parse.unquote(parsed.path)
    if "\x00" in name:
        raise invalid(f"{where}: file: ref holds a NUL character, which no file name can")
    root = Path(policy.file_root).resolve()
    path = Path(name)
    target = (path if path.is_absolute() else root / path).resolve()
    if target != root and root not in target.parents:
        raise precondition(f"{where}: file: ref {ref!r} is outside the allowed root")
    try:
        size = os.path.getsize(target)
        if size > policy.max_bytes:
            raise exhausted(f"{where}: file: ref is {size} bytes, over the limit {policy.max_bytes}")
        return target.read_bytes()
    except OSError as exc:
        raise GatewayError(Code.NOT_FOUND, f"{where}: file: ref cannot be read ({exc.strerror})") from None


async def _http(ref: str, policy: RefPolicy, where: str) -> bytes:
    if not policy.http:
        raise precondition(f"{where}: http(s) refs are disabled on this server (evergreen_http_refs is off)")
    try:
        client = httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=True, max_redirects=3)
        async with client, client.stream("GET", ref) as response:
            if response.status_code != 200:
                raise precondition(f"{where}: HTTP {response.status_code} fetching {ref!r}")
            body = bytearray()
            async for piece in response.aiter_bytes():
                body += piece
                if len(body) > policy.max_bytes:
                    raise exhausted(f"{where}: larger than the limit {policy.max_bytes} bytes: {ref!r}")
            return bytes(body)
    except httpx.TimeoutException:
        raise GatewayError(Code.UNAVAILABLE, f"{where}: took over {policy.timeout_s}s fetching {ref!r}") from None
    except httpx.HTTPError as exc:
        raise GatewayError(Code.UNAVAILABLE, f"{where}: fetch failed ({exc}): {ref!r}") from None
