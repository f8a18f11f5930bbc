"""Readouts and steering inside vLLM's compiled forward pass, through buffers that outlive the step.

Forward hooks never fire inside a graph that torch.compile traced or a CUDA graph replays, so
each decoder layer a pack or an SAE names gets a forward that calls the custom ops
``prismgate::steer`` (vectors added from host-filled buffers, :class:`SteerBuffers`; gates read
through :class:`GateReadouts`) and ``prismgate::readout`` (the stream dotted with the layer's
directions, into a buffer allocated once). The layer forwards must be replaced before vLLM's
first, compiling run (:mod:`prismgate.engines.vllm.workers`). How the ops keep the engine's
contract is docs/vllm.md, "The compiled ops".

Only torch (and the core) is imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prismgate.engines.introspect import decoder_layers
from prismgate.engines.invariant_rows import in_blocks
from prismgate.engines.vllm.encoder import SaeWeights
from prismgate.engines.vllm.sae_steer import SaeSteerBuffers, feature_steer
from prismgate.engines.vllm.steer import FEATURE_GATES, MAX_ROUNDS, RAW_SLOTS, steering_layers

DIRECTIONS = "prismgate_directions"
READOUTS = "prismgate_readouts"
WANTED = "prismgate_readouts_wanted"
STEER = "prismgate_steer_"  # prefix of the steering buffers' names


def recording(hidden: torch.Tensor) -> bool:
    """Whether this call is being recorded into a CUDA graph, whose replays skip the ops' host code."""
    return bool(hidden.is_cuda and torch.cuda.is_current_stream_capturing())


@torch.library.custom_op(
    "prismgate::readout",
    mutates_args=("out",),
    schema="(Tensor hidden, Tensor? residual, Tensor directions, Tensor(a!) out, Tensor wanted) -> ()",
)
def readout(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    directions: torch.Tensor,
    out: torch.Tensor,
    wanted: torch.Tensor,
) -> None:
    """Write the readouts of the residual stream ``hidden + residual`` into ``out``'s first rows.

    ``wanted`` (host memory) is 0 in a step where no request reads readouts: the op returns
    at once (the buffer keeps the last step's values, which nobody reads). While a CUDA graph
    is captured it always writes, since its replays skip this host code.
    """
    if not wanted.item() and not recording(hidden):
        return
    n = min(int(hidden.shape[0]), int(out.shape[0]))
    stream = hidden[:n] if residual is None else hidden[:n] + residual[:n]
    project(stream, directions, out[:n])


def project(stream: torch.Tensor, directions: torch.Tensor, out: torch.Tensor) -> None:
    """``out = stream @ directions`` in float32, each row's bits the same in a batch of any size.

    The product runs in blocks of a fixed number of rows (:mod:`prismgate.engines.invariant_rows`
    says why), so a row meets the same kernel in a step of any size.
    """
    out.copy_(in_blocks(stream.to(torch.float32), lambda rows: rows @ directions))


@readout.register_fake
def _readout_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    directions: torch.Tensor,
    out: torch.Tensor,
    wanted: torch.Tensor,
) -> None:
    return None


@torch.library.custom_op(
    "prismgate::steer",
    mutates_args=("hidden", "residual", "pre"),
    schema=(
        "(Tensor(a!) hidden, Tensor(b!) residual, Tensor table, Tensor index, Tensor scale, Tensor normed, "
        "Tensor rounds, Tensor directions, Tensor(c!) pre, int slot, Tensor prev, Tensor gate, Tensor threshold, "
        "Tensor above, Tensor carried, Tensor[] sae, int arch, int sae_k) -> ()"
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
    directions: torch.Tensor,
    pre: torch.Tensor,
    slot: int,
    prev: torch.Tensor,
    gate: torch.Tensor,
    threshold: torch.Tensor,
    above: torch.Tensor,
    carried: torch.Tensor,
    sae: list[torch.Tensor],
    arch: int,
    sae_k: int,
) -> None:
    """Add ``scale * table[index]`` (times the stream's norm where ``normed``) to the stream, round by round.

    ``rounds`` (host memory) holds how many rounds this step uses, 0 when no row steers, whether
    any of them is norm-matched, whether a gate reads this layer's readouts (then the stream's
    readouts go to ``pre[slot]`` first, before this layer's vectors), whether any round is gated,
    whether a gate reads an SAE feature here, which rounds clamp a feature (a bit mask) and how
    many rows the SAE encodes (:mod:`.sae_steer`). While a CUDA graph is captured the host values
    mean nothing at replay, so everything is recorded, norms, gate readouts, gates and clamps all;
    unused rounds have index 0 (and no clamp) and select nothing.

    A gated round (``gate[row, k]`` = (layer slot, column), slot -1: ungated) lets a row's vector
    in only while the gate value of the row's previous position passes ``threshold``: the
    row ``prev[row]`` of this pass, or (``prev`` -1) the value ``carried`` from the request's
    step before (NaN where there is none: closed). Columns below the pack's concept count are
    readouts; the ones after, feature activations a feature gate reads (:mod:`.sae_steer`).

    ``sae`` is empty at a layer without an SAE, else its tensors and feature-steering buffers
    (:class:`.sae_steer.SaeSteerBuffers`); ``arch`` and ``sae_k`` say how it encodes (:mod:`.encoder`).
    """
    n = min(int(hidden.shape[0]), int(index.shape[0]))
    m: int | None
    if recording(hidden):
        used, norms, reads, gates = int(index.shape[1]), 1, 1, 1
        feature_reads, clamps, m = (1, (1 << used) - 1, None) if sae else (0, 0, None)
    else:
        used, norms, reads, gates, feature_reads, clamps, m = (int(v) for v in rounds.tolist())
    if n == 0 or (used == 0 and reads == 0 and feature_reads == 0):
        return
    h, r = hidden[:n], residual[:n]
    stream = h + r  # what the next layer's fused add (and the final norm) computes
    concepts = int(directions.shape[1])
    if reads and concepts:
        project(stream, directions, pre[slot, :n, :concepts])
    features = feature_steer(sae, arch, sae_k, n, m) if (feature_reads or clamps) else None
    encoded: torch.Tensor | None = None  # the encoded rows' pre-activations, in the stream before this layer's vectors
    if feature_reads and features is not None:
        encoded = features.pre(stream)
        features.read_gates(encoded, pre[slot, :, -FEATURE_GATES:])  # after the pack's concepts (none here, maybe)
    if used == 0:
        return
    steered: torch.Tensor | None = None
    for k in range(used):
        on = (index[:n, k] != 0) & (scale[:n, k] != 0)  # a vector of scale 0 adds nothing: the row stays unwritten
        f = stream.to(torch.float32)
        add = table.index_select(0, index[:n, k]) * scale[:n, k].unsqueeze(-1)
        if norms:
            add = torch.where(normed[:n, k].unsqueeze(-1), add * f.norm(dim=-1, keepdim=True), add)
        if clamps >> k & 1 and features is not None:  # after round 0 the stream may have moved: encode it again
            encoded = encoded if (encoded is not None and k == 0) else features.pre(stream)
            add, on = features.clamp(encoded, k, add, on)
        if gates:
            source = gate[:n, k]
            before = prev[:n]
            value = pre[source[:, 0].clamp(min=0), before.clamp(min=0), source[:, 1].clamp(min=0)]
            value = torch.where(before >= 0, value, carried[:n, k])
            passes = torch.where(above[:n, k], value > threshold[:n, k], value < threshold[:n, k])
            on = on & ((source[:, 0] < 0) | passes)
        on = on.unsqueeze(-1)
        added = (f + add).to(hidden.dtype)
        # one round: rows it skips are put back whole below; more: a round a row skips leaves it as it is
        stream = added if used == 1 else torch.where(on, added, stream)
        steered = on if steered is None else steered | on
    assert steered is not None
    h.copy_(torch.where(steered, stream, h))
    r.copy_(torch.where(steered, torch.zeros_like(r), r))


@steer.register_fake
def _steer_fake(*args: Any, **kwargs: Any) -> None:  # it only writes its inputs in place: no output to describe
    return None


class GateReadouts:
    """What every steered layer's gates read: the values before steering, and each row's previous row.

    ``pre`` is ``[layers, rows, n_concepts + features]`` float32: per steering layer of this worker,
    the readouts of the stream after it, taken before that layer's own vectors are added (a layer
    writes its slice in the steps a gate reads it), then ``features`` columns for the SAE feature
    activations feature gates read there (:mod:`.sae_steer`). ``prev`` is ``[rows]``: the flat row
    of each row's previous position in this pass, -1 for a request's first row.
    """

    def __init__(self, n_layers: int, n_concepts: int, rows: int, device: Any, features: int = 0) -> None:
        self.n_concepts = n_concepts
        self.pre = torch.zeros(n_layers, rows, n_concepts + features, dtype=torch.float32, device=device)
        self.prev = torch.full((rows,), -1, dtype=torch.int64, device=device)


class SteerBuffers:
    """One layer's steering inputs: what the host writes before a step and the graph reads in it.

    ``table`` rows: 0 the zero vector, then the pack's unit directions at this layer (concept
    ``c`` is row ``1 + c``), then :data:`RAW_SLOTS` rows for raw directions. ``index``,
    ``scale`` and ``normed`` are ``[rows, width]`` (``width``: the most rounds of a step); so are the
    gates' ``threshold``, ``above`` and ``carried``, and ``gate`` ``[rows, width, 2]`` (the gate value's
    layer slot and column; slot -1: ungated). ``rounds`` is seven ints in host memory: the
    rounds this step uses, whether any is norm-matched, whether a gate reads this layer's
    readouts, whether any round is gated, whether a gate reads an SAE feature here, the rounds
    that clamp (a bit mask) and the rows the SAE encodes. ``reads`` are the buffers shared by every
    layer; ``sae`` the layer's feature-steering buffers (:mod:`.sae_steer`), None without an SAE.
    At a layer an SAE reads after that is not a pack layer, ``units`` is zeros (no concept there).
    """

    def __init__(
        self,
        layer: torch.nn.Module,
        units: torch.Tensor,
        rows: int,
        reads: GateReadouts,
        width: int = MAX_ROUNDS,
        sae: SaeWeights | None = None,
    ) -> None:
        device = units.device
        table = torch.zeros(1 + units.shape[0] + RAW_SLOTS, units.shape[1], dtype=torch.float32, device=device)
        table[1 : 1 + units.shape[0]] = units
        parts = {
            "table": table,
            "index": torch.zeros(rows, width, dtype=torch.int64, device=device),
            "scale": torch.zeros(rows, width, dtype=torch.float32, device=device),
            "normed": torch.zeros(rows, width, dtype=torch.bool, device=device),
            "gate": torch.full((rows, width, 2), -1, dtype=torch.int64, device=device),
            "threshold": torch.zeros(rows, width, dtype=torch.float32, device=device),
            "above": torch.zeros(rows, width, dtype=torch.bool, device=device),
            "carried": torch.full((rows, width), float("nan"), dtype=torch.float32, device=device),
            "pre": reads.pre,
            "prev": reads.prev,
        }
        parts["rounds"] = torch.zeros(7, dtype=torch.int64)  # host memory, read by the op's host code only
        for name, tensor in parts.items():
            layer.register_buffer(STEER + name, tensor, persistent=False)
        self.table, self.index, self.scale, self.normed = table, parts["index"], parts["scale"], parts["normed"]
        self.gate, self.threshold, self.above = parts["gate"], parts["threshold"], parts["above"]
        self.carried = parts["carried"]
        self.rounds = parts["rounds"]
        self.reads = reads
        self.raw_base = 1 + int(units.shape[0])
        self.sae = SaeSteerBuffers(layer, sae, rows, width) if sae is not None else None
        self.arch, self.k = (sae.arch, sae.k) if sae is not None else (0, 0)


def unit_directions(directions: Any, device: Any) -> torch.Tensor:
    """A pack layer's ``[n_concepts, hidden]`` at unit length, exactly as the transformers engine makes them."""
    d = torch.as_tensor(directions, dtype=torch.float32).to(device)
    return d / d.norm(dim=-1, keepdim=True)


def install(
    model: Any,
    directions: list[Any],
    layers: list[int],
    rows: int,
    *,
    steering_rounds: int = 0,
    wanted: torch.Tensor | None = None,
    saes: Sequence[SaeWeights] = (),
) -> tuple[list[torch.Tensor], list[SteerBuffers]]:
    """Give each named layer an in-graph readout (and steering); returns the readout buffers in pack
    order and the steering buffers in steering order (:func:`.steer.steering_layers`).

    ``directions[i]`` is the pack's ``[n_concepts, hidden]`` for ``layers[i]``; ``rows`` is
    the most tokens one forward pass can hold (vLLM's batched-token budget or CUDA-graph size).
    ``steering_rounds`` is how many vectors a row may get at one layer (0: the layers do not steer).
    ``wanted`` is one int64 in host memory that the host sets before each step: 0 when no
    request reads readouts in it (the readout ops skip their work); None: always read.
    ``saes``: the SAEs' tensors (with ``W_dec``); with steering, their layers steer too (a feature's
    direction, clamps, gates on a feature), pack layers or not.
    """
    if wanted is None:
        wanted = torch.ones(1, dtype=torch.int64)
    decoder = decoder_layers(model)
    device = next(model.parameters()).device
    n_concepts = int(torch.as_tensor(directions[0]).shape[0]) if directions else 0
    by_layer = {w.layer: w for w in saes} if steering_rounds > 0 else {}
    order = steering_layers(layers, list(by_layer)) if steering_rounds > 0 else []
    reads = GateReadouts(len(order), n_concepts, rows, device, FEATURE_GATES if by_layer else 0)
    buffers: list[torch.Tensor] = []
    for index, direction in zip(layers, directions, strict=True):
        layer = decoder[index]
        d = torch.as_tensor(direction, dtype=torch.float32).to(device).T.contiguous()  # [hidden, n_concepts]
        out = torch.zeros(rows, d.shape[1], dtype=torch.float32, device=device)
        # Buffers, not plain attributes: compilers treat module buffers as static inputs.
        layer.register_buffer(DIRECTIONS, d, persistent=False)
        layer.register_buffer(READOUTS, out, persistent=False)
        layer.register_buffer(WANTED, wanted, persistent=False)  # the one host flag, shared by every layer
        buffers.append(out)
    steer_buffers: list[SteerBuffers] = []
    for index in order:
        layer = decoder[index]
        if index in layers:
            units = unit_directions(directions[layers.index(index)], device)
        else:  # an SAE's layer only: no concept, no readout
            hidden = int(by_layer[index].W_enc.shape[0])
            units = torch.zeros(n_concepts, hidden, device=device)
            layer.register_buffer(DIRECTIONS, torch.zeros(hidden, 0, device=device), persistent=False)
        steer_buffers.append(SteerBuffers(layer, units, rows, reads, steering_rounds, by_layer.get(index)))
    for index in dict.fromkeys([*layers, *order]):
        at = order.index(index) if index in order else None
        steering = steer_buffers[at] if at is not None else None
        layer = decoder[index]
        layer.forward = _with_readout(layer, layer.forward, at, steering, readout=index in layers)
    return buffers, steer_buffers


_STEER_INPUTS = (
    "table", "index", "scale", "normed", "rounds", "pre", "prev", "gate", "threshold", "above", "carried",
)  # fmt: skip


def _with_readout(
    layer: torch.nn.Module, forward: Any, slot: int | None, steering: SteerBuffers | None, *, readout: bool
) -> Any:
    """``slot``: the layer's index among this worker's steering layers, None when it does not steer;
    ``readout``: whether it is a pack layer (its readouts are written after its steering)."""
    arch, sae_k = (steering.arch, steering.k) if steering is not None else (0, 0)

    def forward_with_readout(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        if isinstance(output, tuple):  # vLLM's decoder layers return (hidden_states, residual)
            residual = output[1] if len(output) > 1 else None
            hidden = output[0]
        else:
            hidden, residual = output, None
        if slot is not None:
            if residual is None:
                raise TypeError(f"prismgate steers layers that return (hidden, residual), not {type(layer).__name__}")
            buffer = {name: getattr(layer, STEER + name) for name in _STEER_INPUTS}
            directions = getattr(layer, DIRECTIONS)
            sae = SaeSteerBuffers.inputs(layer)
            torch.ops.prismgate.steer(
                hidden, residual, directions=directions, slot=slot, sae=sae, arch=arch, sae_k=sae_k, **buffer
            )
        if readout:
            torch.ops.prismgate.readout(
                hidden, residual, getattr(layer, DIRECTIONS), getattr(layer, READOUTS), getattr(layer, WANTED)
            )
        return output

    return forward_with_readout
