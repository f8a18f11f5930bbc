"""A streamed token's chunk, assembled from precomputed parts, is the same text as the general encoding.

The stream writes :meth:`Format.piece_payloads` for every token; the general path
(``dumps`` of :meth:`Format.piece`) is what every other chunk and every non-streamed
answer uses. Both must agree byte for byte, for both formats, with and without readouts,
a session, the usage option, and text that JSON must escape.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest

from prismgate.codecs.openai.formats import ChatFormat, CompletionFormat, Format, dumps
from prismgate.codecs.openai.generation import Piece, Token
from prismgate.codecs.openai.plan import Plan
from prismgate.codecs.openai.readouts import ReadoutAxes, values_json

AXES = ReadoutAxes(layers=(4, 8), concepts=("code", "formality", "french"), layer_index=(0, 1), concept_index=(0, 1, 2))
# the base64 forms (float32, float16) take the same fast path
B64 = [dataclasses.replace(AXES, binary=np.dtype(t)) for t in ("<f4", "<f2")]
TEXTS = ["Hello", " wörld", 'quote " and \\ back', "tab\tnew\nline \u2028", "", "\U0001f600"]


def plan(axes: ReadoutAxes | None, logprobs: bool = False, session: str | None = None) -> Plan:
    return Plan(model="smöl-m2", turn=None, session_id=session, echo_text=None, axes=axes, want_logprobs=logprobs)  # type: ignore[arg-type]


def pieces(rng: np.random.Generator, scale: float) -> list[Piece]:
    out = []
    for i, text in enumerate(TEXTS):
        tokens = [
            Token(
                id=100 + i * 3 + j,
                position=7 + i * 3 + j,
                text=text[:j],
                bytes=list(text[:j].encode()),
                logprob=-0.5 * j,
                top=[(text[:j], list(text[:j].encode()), -0.5 * j)],
                readout=(rng.standard_normal((2, 3)) * scale).astype(np.float32),
            )
            for j in range(i % 3 + 1)
        ]
        out.append(Piece(text, tokens))
    return out


def twins(kind: type[Format], p: Plan, include_usage: bool) -> tuple[Format, Format]:
    """Two formats of one response (same id and time): one to stream, one to encode the general way."""
    a, b = kind(p, include_usage), kind(p, include_usage)
    b.id, b.created, b._open = a.id, a.created, a._open
    return a, b


@pytest.mark.parametrize(
    ("kind", "axes", "session", "include_usage", "scale"),
    list(
        itertools.product(
            [ChatFormat, CompletionFormat], [None, AXES, *B64], [None, "s-1"], [False, True], [1.0, 1e-6, 3e7]
        )
    ),
)
def test_streamed_chunks_are_the_general_encoding(
    kind: type[Format], axes: ReadoutAxes | None, session: str | None, include_usage: bool, scale: float
) -> None:
    fast, general = twins(kind, plan(axes, session=session), include_usage)
    rng = np.random.default_rng(0)
    for piece in pieces(rng, scale):
        assert fast.piece_payloads(piece) == [dumps(chunk) for chunk in general.piece(piece)]
    assert fast.text_offset == general.text_offset


@pytest.mark.parametrize("kind", [ChatFormat, CompletionFormat])
def test_logprobs_and_non_finite_readouts_take_the_general_path(kind: type[Format]) -> None:
    rng = np.random.default_rng(1)
    fast, general = twins(kind, plan(AXES, logprobs=True), True)
    for piece in pieces(rng, 1.0):
        assert fast.piece_payloads(piece) == [dumps(chunk) for chunk in general.piece(piece)]
    bad = Piece("x", [Token(1, 2, "x", [120], readout=np.array([[np.nan, 1.0, 2.0]] * 2, dtype=np.float32))])
    fast, _ = twins(kind, plan(AXES), False)
    with pytest.raises(ValueError, match="not JSON compliant"):  # as every payload with a NaN
        fast.piece_payloads(bad)


def test_readout_values_are_numpys_shortest_float32_text_printed_as_json() -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, size=(4000, 2, 3), dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([[1e-4, 9.999999e-5, 1e16], [1048576.0, -0.0, 2.0**-149]], dtype=np.float32)
    for part in [*bits, edges]:
        part = np.where(np.isfinite(part), part, np.float32(1.5))
        expected: Any = [[float(str(v)) for v in row] for row in part]  # str(): numpy's shortest form
        assert values_json(part) == dumps(expected)
