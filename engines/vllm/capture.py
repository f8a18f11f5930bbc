"""Readouts computed inside vLLM's compiled forward pass, into buffers that outlive the step.

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

The layer forwards must be replaced before vLLM runs the model for the first time: that
first run is when it compiles (see :mod:`prismgate.engines.vllm.workers`).

Only torch is imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

from typing import Any

import torch

from prismgate.engines.readouts.probe import decoder_layers

DIRECTIONS = "prismgate_directions"
READOUTS = "prismgate_readouts"


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


def install(model: Any, directions: list[Any], layers: list[int], rows: int) -> list[torch.Tensor]:
    """Give each named layer an in-graph readout; returns the buffers, one per layer in pack order.

    ``directions[i]`` is the pack's ``[n_concepts, hidden]`` for ``layers[i]``; ``rows`` is
    the most tokens one forward pass can hold (vLLM's batched-token budget or CUDA-graph size).
    """
    decoder = decoder_layers(model)
    device = next(model.parameters()).device
    buffers: list[torch.Tensor] = []
    for index, direction in zip(layers, directions, strict=True):
        layer = decoder[index]
        d = torch.as_tensor(direction, dtype=torch.float32).to(device).T.contiguous()  # [hidden, n_concepts]
        out = torch.zeros(rows, d.shape[1], dtype=torch.float32, device=device)
        # Buffers, not plain attributes: compilers treat module buffers as static inputs.
        layer.register_buffer(DIRECTIONS, d, persistent=False)
        layer.register_buffer(READOUTS, out, persistent=False)
        layer.forward = _with_readout(layer, layer.forward)
        buffers.append(out)
    return buffers


def _with_readout(layer: torch.nn.Module, forward: Any) -> Any:
    def forward_with_readout(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        if isinstance(output, tuple):  # vLLM's decoder layers return (hidden_states, residual)
            residual = output[1] if len(output) > 1 else None
            hidden = output[0]
        else:
            hidden, residual = output, None
        torch.ops.prismgate.readout(hidden, residual, getattr(layer, DIRECTIONS), getattr(layer, READOUTS))
        return output

    return forward_with_readout
