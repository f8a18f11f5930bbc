"""Input tensors -> rows: a ``prompt`` String tensor or a ``tokens`` integer tensor.

* ``prompt``: String, shape ``[batch]`` or scalar; each element is one user message;
* ``tokens``: any integer type (Int32/Int64 usual), shape ``[batch, n]`` or ``[n]``; raw
  token ids, trailing ``-1`` entries are padding (so a ``tokens`` output feeds back in).
"""

from __future__ import annotations

from dataclasses import dataclass

from prismgate.codecs.graphpipe.wire import INTEGER_TYPES, InferCall, WireTensor, type_name
from prismgate.core.errors import invalid
from prismgate.schemas.graphpipe.fb.graphpipe_generated import Type

PROMPT, TOKENS = "prompt", "tokens"
INPUTS = (PROMPT, TOKENS)
DEFAULT_INPUT = PROMPT
PAD_ID = -1


@dataclass(slots=True)
class Rows:
    """The batch, before tokenisation: either text prompts or token-id rows."""

    prompts: list[str] | None = None
    tokens: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.prompts if self.prompts is not None else self.tokens or [])


def bind_inputs(call: InferCall, max_batch: int) -> Rows:
    """Name each input tensor (by ``input_names``, or by its type when none are given)."""
    if not call.inputs:
        raise invalid(f"the request has no input tensors; send one named {' or '.join(map(repr, INPUTS))}")
    if call.input_names:
        if len(call.input_names) != len(call.inputs):
            raise invalid(
                f"{len(call.input_names)} input names for {len(call.inputs)} input tensors; "
                "the spec requires one name per tensor"
            )
        names = call.input_names
    elif len(call.inputs) == 1:
        names = [TOKENS if call.inputs[0].type in INTEGER_TYPES else DEFAULT_INPUT]
    else:
        raise invalid(f"{len(call.inputs)} input tensors without input_names; name them ({', '.join(INPUTS)})")
    for name in names:
        if name not in INPUTS:
            raise invalid(f"unknown input {name!r}; this server takes {' or '.join(map(repr, INPUTS))}")
    if len(set(names)) != len(names):
        raise invalid(f"input names {names} repeat a name")
    if len(names) > 1:
        raise invalid("give either a prompt or a tokens input, not both")
    tensor = call.inputs[0]
    rows = _prompts(tensor) if names[0] == PROMPT else _token_rows(tensor)
    if len(rows) > max_batch:
        raise invalid(f"the batch has {len(rows)} rows; this server takes at most {max_batch} (graphpipe_max_batch)")
    return rows


def _prompts(t: WireTensor) -> Rows:
    if t.type != Type.String:
        raise invalid(f"input 'prompt' must be a String tensor, got {type_name(t.type)}")
    if len(t.shape) > 1:
        raise invalid(f"input 'prompt' must have shape [batch] or be a scalar, got {list(t.shape)}")
    prompts = []
    for i, raw in enumerate(t.strings):
        try:
            prompts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid(f"prompt row {i} is not valid UTF-8: {raw[:40]!r}") from None
    return Rows(prompts=prompts)


def _token_rows(t: WireTensor) -> Rows:
    if t.type not in INTEGER_TYPES or t.values is None:
        raise invalid(f"input 'tokens' must be an integer tensor (Int32 or Int64), got {type_name(t.type)}")
    if len(t.shape) not in (1, 2):
        raise invalid(f"input 'tokens' must have shape [batch, n] or [n], got {list(t.shape)}")
    matrix = t.values.reshape(1, -1) if len(t.shape) == 1 else t.values
    rows = []
    for row in matrix.tolist():
        while row and row[-1] == PAD_ID:
            row.pop()
        rows.append(row)
    return Rows(tokens=rows)
