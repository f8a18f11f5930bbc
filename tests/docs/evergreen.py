"""Replay a literal Evergreen exchange from the docs over a real WebSocket and compare the answer.

``> `` lines are frames the client sends, ``< `` lines frames the server answers. How the server
groups fragments into frames is its own business (it sends what it has queued), so the answer
is compared fragment by fragment, in order; the string ``"..."`` in the docs matches any value.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets

ANY = "..."
ANSWER_TIMEOUT_S = 120


def parse(transcript: str) -> tuple[list[str], list[dict[str, Any]]]:
    sent: list[str] = []
    expected: list[dict[str, Any]] = []
    for number, line in enumerate(transcript.splitlines(), 1):
        if line.startswith("> "):
            sent.append(json.dumps(json.loads(line[2:])))
        elif line.startswith("< "):
            expected.extend(json.loads(line[2:])["nodeFragments"])
        elif line.strip():
            raise ValueError(f"line {number}: an Evergreen exchange has only '> ' and '< ' lines: {line!r}")
    return sent, expected


def differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    if expected == ANY:
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}.{k}: missing" for k in expected if k not in actual]
        out += [f"{where}.{k}: not in the docs ({actual[k]!r})" for k in actual if k not in expected]
        for k in expected.keys() & actual.keys():
            out += differences(expected[k], actual[k], f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in differences(e, a, f"{where}[{i}]")
        ]
    return [] if expected == actual else [f"{where}: docs say {expected!r}, the server sent {actual!r}"]


async def replay(url: str, transcript: str) -> list[str]:
    """Send the transcript's frames; the differences between its answer and the server's (none: it matches)."""
    sent, expected = parse(transcript)
    received: list[dict[str, Any]] = []
    async with websockets.connect(url, max_size=None) as ws:
        for frame in sent:
            await ws.send(frame)
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            while len(received) < len(expected):
                received.extend(json.loads(await ws.recv()).get("nodeFragments", []))
        try:  # nothing more may follow
            async with asyncio.timeout(0.5):
                received.extend(json.loads(await ws.recv()).get("nodeFragments", []))
        except TimeoutError:
            pass
    return differences(expected, received, "fragments")
