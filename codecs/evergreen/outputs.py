"""What GENERATE writes into its output nodes: the mimetypes and the bytes of each line.

``response`` holds the generated text; ``readouts`` and ``logprobs`` hold one NDJSON
line per generated token (readouts after a header line describing the manifest);
``features`` one NDJSON line per generated token after a header line (SAE features,
docs/sae.md); ``usage`` holds one JSON object once the action ends. docs/evergreen.md is the reference.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from prismgate.codecs.binary_numbers import BASE64, INT32, b64, dtype_name
from prismgate.codecs.evergreen.fragments import NodeWriter
from prismgate.codecs.features import token_features
from prismgate.core.engine import ReadoutManifest, Tokenizer
from prismgate.core.events import Done, TokenEvent
from prismgate.core.features import FeatureManifest, FeatureSpec
from prismgate.core.turns import Turn

TEXT_MIME = "text/plain"
OUTPUT_ROLE = "assistant"
READOUTS_MIME = "application/x-ndjson; schema=prismgate.readouts.v1"
LOGPROBS_MIME = "application/x-ndjson; schema=prismgate.logprobs.v1"
USAGE_MIME = "application/json; schema=prismgate.usage.v1"
FEATURES_MIME = "application/x-ndjson; schema=prismgate.features.v1"

TEXT_OUTPUTS = ("response", "text")
EXTRA_OUTPUTS = ("readouts", "logprobs", "features", "usage")

_MIMES = {
    "text": (TEXT_MIME, OUTPUT_ROLE),
    "readouts": (READOUTS_MIME, ""),
    "logprobs": (LOGPROBS_MIME, ""),
    "usage": (USAGE_MIME, ""),
    "features": (FEATURES_MIME, ""),
}


def writers(outputs: dict[str, str]) -> dict[str, NodeWriter]:
    """One writer per output (key -> node id), with the output's mimetype."""
    return {key: NodeWriter(node_id, *_MIMES[key]) for key, node_id in outputs.items()}


def readout_header(model: str, manifest: ReadoutManifest, binary: np.dtype | None = None) -> bytes:
    header: dict[str, Any] = {
        "model": model,
        "concepts": list(manifest.concepts),
        "layers": list(manifest.layers),
        "layerConvention": manifest.layer_convention,
        "shape": ["layers", "concepts"],
        "centers": None if manifest.centers is None else [[number(v) for v in row] for row in manifest.centers],
    }
    if binary is not None:  # said only to a client that asked: the text form's bytes stay as they were
        header.update(encodingFormat=BASE64, dtype=dtype_name(binary))
    return line(header)


def readout_line(index: int, event: TokenEvent, binary: np.dtype | None = None) -> bytes:
    """One token's line: ``line()`` of its dict, printed without building it (a stream writes one per token)."""
    assert event.readout is not None
    values = '"' + b64(event.readout, binary) + '"' if binary is not None else numbers_json(event.readout)
    return (
        f'{{"index":{index:d},"position":{event.position:d},"tokenId":{event.id:d},'
        f'"text":{_text(event.text or "")},"values":{values}}}\n'
    ).encode()


def numbers_json(readout: np.ndarray) -> str:
    """``[[number(v) for v in row] for row in readout]`` as JSON text, formatted in one go.

    ``%.6g`` of a value is what ``number`` prints whenever it holds a point and no exponent
    (a decimal of at most 6 digits is the shortest repr of the double it parses to, and both
    print positionally there); integers (``3``, ``-0``), exponents and non-finite values
    (``nan``, ``inf``) are the rare rest, printed the general way.
    """
    count = readout.size
    text = _number_format(readout.shape) % tuple(readout.ravel().tolist())
    if text.count(".") == count and "e" not in text and "n" not in text:
        return text
    return _text([[number(v) for v in row] for row in readout.tolist()])


@functools.lru_cache(maxsize=16)
def _number_format(shape: tuple[int, ...]) -> str:
    layers, concepts = shape
    return "[" + ",".join(["[" + ",".join(["%.6g"] * concepts) + "]"] * layers) + "]"


def features_header(model: str, spec: FeatureSpec) -> bytes:
    return line({"model": model, "layers": list(spec.layers), "topK": spec.top_k, "ids": list(spec.ids)})


def features_line(index: int, event: TokenEvent, manifest: FeatureManifest | None) -> bytes:
    """One token's features, as the OpenAI extension writes them (ids, activations, labels; watched ids)."""
    assert event.features is not None
    entry = token_features(event.position, event.id, event.text or "", event.features, manifest)
    layers = entry["layers"]
    return line(
        {"index": index, "position": event.position, "tokenId": event.id, "text": entry["token"], "layers": layers}
    )


def logprob_line(index: int, event: TokenEvent, tokenizer: Tokenizer, binary: np.dtype | None = None) -> bytes:
    """One token's logprob and its alternatives: a ``top`` list, or with ``binary`` two base64 arrays.

    The base64 form leaves out the alternatives' text (a client that wants it asks the
    tokenizer once per id), which is most of what printing them costs.
    """
    assert event.logprob is not None
    entry: dict[str, Any] = {
        "index": index,
        "position": event.position,
        "tokenId": event.id,
        "text": event.text or "",
        "logprob": number(event.logprob),
    }
    alternatives = event.top_logprobs or []
    if binary is None:
        entry["top"] = [
            {"tokenId": t, "text": tokenizer.token_text(t), "logprob": number(lp)} for t, lp in alternatives
        ]
    else:
        entry["topIds"] = b64(np.array([t for t, _ in alternatives], dtype=INT32), INT32)
        entry["topLogprobs"] = b64(np.array([lp for _, lp in alternatives], dtype=np.float64), binary)
    return line(entry)


def planned_usage(turn: Turn) -> dict[str, Any]:
    """What the usage object says before the engine runs (how much of the session was reused)."""
    return {
        "promptTokens": turn.prompt_tokens,
        "reusedTokens": turn.reused_tokens,
        "appendedTokens": len(turn.append.tokens),
    }


def done_usage(done: Done) -> dict[str, Any]:
    out: dict[str, Any] = {
        "finishReason": done.finish_reason.value,
        "promptTokens": done.prompt_tokens,
        "completionTokens": done.completion_tokens,
        "cachedTokens": done.cached_tokens,
        "prefilledTokens": done.prefilled_tokens,
    }
    if done.stop_string is not None:
        out["stopString"] = done.stop_string
    return out


def usage_bytes(usage: dict[str, Any]) -> bytes:
    return json.dumps(usage, separators=(",", ":")).encode()


def line(obj: Any) -> bytes:
    return (_text(obj) + "\n").encode()


# json.dumps with these options, without building an encoder per call
_text = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def number(value: float) -> float | None:
    """A float for JSON: 6 significant digits, ``null`` for NaN and infinities."""
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        return None
    return float(f"{v:.6g}")
