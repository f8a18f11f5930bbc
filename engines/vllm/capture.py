"""Readouts and steering inside vLLM's compiled forward pass, through buffers that outlive the step.

Forward hooks never fire inside a graph that torch.compile traced or a CUDA graph replays,
so the readout is part of the graph itself: each decoder layer a concept pack names gets a
forward that, after the layer's own, calls the custom op ``prismgate::readout``. The op
writes ``(hidden + residual) @ D_L`` for every row of the batch into a buffer allocated
once at load time (``[rows, n_concepts]`` float32, one per layer), so the captured graph
writes to the same memory at every replay. The host then reads the rows of the requests
that asked, after the step (:mod:`prismgate.engines.vllm.worker`).

Why a custom op with ``mutates_args``: Dynamo keeps it in the graph as one opaque node
(it never traces into it, so no shape specialisation leaks out), Inductor re-inplaces the
write, and CUDA graphs capture it like any other kernel. Rows past the step's real tokens
(CUDA-graph padding) are written too and never read.

Steering is the same idea the other way round: the custom op ``prismgate::steer``, called
after the layer's own forward and before its readout, adds vectors to the residual stream
from buffers the host fills before each step (:class:`SteerBuffers`): per row of the batch
and per round, an index into the layer's vector table (row 0 is no vector), a scale and
whether the scale is a multiple of the stream's norm. The arithmetic is the transformers
engine's (:mod:`prismgate.engines.hf.steering`): the stream in the model's dtype, the vector
added in float32, cast back once per round. A row no vector touches keeps its ``hidden``
and ``residual`` bit for bit (a masked select, never an add of zero); a steered row gets the
whole stream in ``hidden`` and zero in ``residual``, which every vLLM decoder layer and the
final norm only ever add together.

The layer forwards must be replaced before vLLM runs the model for the first time: that
first run is when it compiles (see :mod:`prismgate.engines.vllm.workers`).

Only torch (and the core) is imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

from typing import Any

import torch

from prismgate.engines.readouts.probe import decoder_layers
from prismgate.engines.vllm.steer import MAX_ROUNDS, RAW_SLOTS

DIRECTIONS = "prismgate_directions"
READOUTS = "prismgate_readouts"
STEER = "prismgate_steer_"  # prefix of the steering buffers' names


@torch.library.custom_op(
    "prismgate::readout",
    mutates_args=("out",),
    schema="(Tensor hidden, Tensor? residual, Tensor directions, Tensor(a!) out) -> ()",
)
def readout(hidden: torch.Tensor, residual: torch.Tensor | None, directions: torch.Tensor, out: torch.Tensor) -> None:
    """Write the readouts of the residual stream ``hidden + residual`` into ``out``'s first rows."""
    n = min(int(hidden.shape[0]), int(out.shape[0]))
    stream = hidden[:n] if residual is None else hidden[:n] + residual[:n]
    torch.mm(stream.to(torch.float32), directions, out=out[:n])


@readout.register_fake
def _readout_fake(
    hidden: torch.Tensor, residual: torch.Tensor | None, directions: torch.Tensor, out: torch.Tensor
) -> None:
    return None


@torch.library.custom_op(
    "prismgate::steer",
    mutates_args=("hidden", "residual"),
    schema=(
        "(Tensor(a!) hidden, Tensor(b!) residual, Tensor table, Tensor index, Tensor scale, Tensor normed, "
        "Tensor rounds) -> ()"
    ),
)
def steer(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor,
    normed: torch.Tensor,
    rounds: torch.Tensor,
) -> None:
    """Add ``scale * table[index]`` (times the stream's norm where ``normed``) to the stream, round by round.

    ``rounds`` (host memory) holds how many rounds this step uses, 0 when no row steers (the
    op then does nothing), and whether any of them is norm-matched. While a CUDA graph is
    captured the host values mean nothing at replay, so every round is recorded, norms and
    all; unused rounds have index 0 and select nothing.
    """
    n = min(int(hidden.shape[0]), int(index.shape[0]))
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        used, norms = int(index.shape[1]), 1
    else:
        used, norms = (int(v) for v in rounds.tolist())
    if used == 0 or n == 0:
        return
    h, r = hidden[:n], residual[:n]
    stream = h + r  # what the next layer's fused add (and the final norm) computes
    steered: torch.Tensor | None = None
    for k in range(used):
        on = (index[:n, k] != 0).unsqueeze(-1)
        f = stream.to(torch.float32)
        add = table.index_select(0, index[:n, k]) * scale[:n, k].unsqueeze(-1)
        if norms:
            add = torch.where(normed[:n, k].unsqueeze(-1), add * f.norm(dim=-1, keepdim=True), add)
        added = (f + add).to(hidden.dtype)
        # one round: rows it skips are put back whole below; more: a round a row skips leaves it as it is
        stream = added if used == 1 else torch.where(on, added, stream)
        steered = on if steered is None else steered | on
    assert steered is not None
    h.copy_(torch.where(steered, stream, h))
    r.copy_(torch.where(steered, torch.zeros_like(r), r))


@steer.register_fake
def _steer_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    table: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor,
    normed: torch.Tensor,
    rounds: torch.Tensor,
) -> None:
    return None


class SteerBuffers:
    """One layer's steering inputs: what the host writes before a step and the graph reads in it.

    ``table`` rows: 0 the zero vector, then the pack's unit directions at this layer (concept
    ``c`` is row ``1 + c``), then :data:`RAW_SLOTS` rows for raw directions. ``index``,
    ``scale`` and ``normed`` are ``[rows, MAX_ROUNDS]``; ``rounds`` is two ints in host memory:
    the rounds this step uses, and whether any is norm-matched.
    """

    def __init__(self, layer: torch.nn.Module, units: torch.Tensor, rows: int) -> None:
        device = units.device
        table = torch.zeros(1 + units.shape[0] + RAW_SLOTS, units.shape[1], dtype=torch.float32, device=device)
        table[1 : 1 + units.shape[0]] = units
        parts = {
            "table": table,
            "index": torch.zeros(rows, MAX_ROUNDS, dtype=torch.int64, device=device),
            "scale": torch.zeros(rows, MAX_ROUNDS, dtype=torch.float32, device=device),
            "normed": torch.zeros(rows, MAX_ROUNDS, dtype=torch.bool, device=device),
        }
        parts["rounds"] = torch.zeros(2, dtype=torch.int64)  # host memory, read by the op's host code only
        for name, tensor in parts.items():
            layer.register_buffer(STEER + name, tensor, persistent=False)
        self.table, self.index, self.scale, self.normed = table, parts["index"], parts["scale"], parts["normed"]
        self.rounds = parts["rounds"]
        self.raw_base = 1 + int(units.shape[0])


def unit_directions(directions: Any, device: Any) -> torch.Tensor:
    """A pack layer's ``[n_concepts, hidden]`` at unit length, exactly as the transformers engine makes them."""
    d = torch.as_tensor(directions, dtype=torch.float32).to(device)
    return d / d.norm(dim=-1, keepdim=True)


def install(
    model: Any, directions: list[Any], layers: list[int], rows: int, *, steering: bool = False
) -> tuple[list[torch.Tensor], list[SteerBuffers]]:
    """Give each named layer an in-graph readout (and steering); returns their buffers in pack order.

    ``directions[i]`` is the pack's ``[n_concepts, hidden]`` for ``layers[i]``; ``rows`` is
    the most tokens one forward pass can hold (vLLM's batched-token budget or CUDA-graph size).
    """
    decoder = decoder_layers(model)
    device = next(model.parameters()).device
    buffers: list[torch.Tensor] = []
    steer_buffers: list[SteerBuffers] = []
    for index, direction in zip(layers, directions, strict=True):
        layer = decoder[index]
        d = torch.as_tensor(direction, dtype=torch.float32).to(device).T.contiguous()  # [hidden, n_concepts]
        out = torch.zeros(rows, d.shape[1], dtype=torch.float32, device=device)
        # Buffers, not plain attributes: compilers treat module buffers as static inputs.
        layer.register_buffer(DIRECTIONS, d, persistent=False)
        layer.register_buffer(READOUTS, out, persistent=False)
        steer_at = SteerBuffers(layer, unit_directions(direction, device), rows) if steering else None
        layer.forward = _with_readout(layer, layer.forward, steer_at is not None)
        buffers.append(out)
        if steer_at is not None:
            steer_buffers.append(steer_at)
    return buffers, steer_buffers


def _with_readout(layer: torch.nn.Module, forward: Any, steers: bool) -> Any:
    def forward_with_readout(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        if isinstance(output, tuple):  # vLLM's decoder layers return (hidden_states, residual)
            residual = output[1] if len(output) > 1 else None
            hidden = output[0]
        else:
            hidden, residual = output, None
        if steers:
            if residual is None:
                raise TypeError(f"prismgate steers layers that return (hidden, residual), not {type(layer).__name__}")
            buffer = {name: getattr(layer, STEER + name) for name in ("table", "index", "scale", "normed", "rounds")}
            torch.ops.prismgate.steer(hidden, residual, **buffer)
        torch.ops.prismgate.readout(hidden, residual, getattr(layer, DIRECTIONS), getattr(layer, READOUTS))
        return output

    return forward_with_readout
