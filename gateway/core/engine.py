"""The Engine contract: what the core needs from anything that runs a model.

An engine sees token ids, images and a :class:`GenerateSpec`; it never sees a wire
type or a session object. Every engine passes the same conformance suite
(``tests/engines/test_conformance.py``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, runtime_checkable

from prismgate.core.actions import Fork, GenerateSpec
from prismgate.core.events import Event
from prismgate.core.features import FeatureManifest
from prismgate.core.health import Health
from prismgate.core.session import ImageSpan


class ChatMessage(TypedDict):
    role: str
    content: str
    tool_calls: NotRequired[list[dict[str, Any]]]  # an assistant's calls: {id, type, function: {name, arguments}}
    tool_call_id: NotRequired[str]  # a tool message: the call it answers


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one model, including its chat template.

    ``encode`` reads text as text: a control token's string (``<|im_end|>``) typed by a
    client becomes the tokens of those characters, never the control token, unless
    ``special`` asks for the control tokens (an operator's choice, see
    :attr:`~prismgate.core.models.Models.specials_in_text`). ``holds_special`` says whether
    a text contains such a string (the chat renderer then keeps it out of the template).
    """

    def encode(self, text: str, *, special: bool = False) -> list[int]: ...

    def holds_special(self, text: str) -> bool: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]: ...

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template declares tool use (renders ``tools``, tool calls and tool results)."""
        ...

    def token_text(self, token_id: int) -> str: ...


@dataclass(frozen=True, slots=True)
class ReadoutManifest:
    """What a readout vector means: ``readout[l][c]`` is concept ``concepts[c]`` at ``layers[l]``.

    ``centers[l][c]``, when the concept pack has them, is that concept's neutral point at that
    layer (see :mod:`prismgate.engines.readouts.pack`): readouts stay raw dot products, and
    clients that display them subtract the center.
    """

    concepts: tuple[str, ...]
    layers: tuple[int, ...]
    hidden_size: int
    dtype: str = "float32"
    layer_convention: str = "residual stream after decoder layer L"
    centers: tuple[tuple[float, ...], ...] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.layers), len(self.concepts))


@dataclass(frozen=True, slots=True)
class VisionTokens:
    """The special tokens that frame an image's placeholder run in the timeline."""

    vision_start: int
    image_pad: int
    vision_end: int


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer
    readouts: ReadoutManifest | None = None
    vision: VisionTokens | None = None
    engine_name: str = ""
    steering: bool = False  # the engine applies GenerateSpec.steering (with a concept pack loaded)
    steering_gates: bool = False  # it also applies readout-gated entries (SteeringEntry.gate)
    steering_off: str | None = None  # the setting that turned steering off on an engine that has it
    steering_features: bool = False  # it also steers by SAE feature (SteeringEntry.feature, clamp, Gate.feature)
    # runs deterministic requests batch-invariant (docs/determinism.md); when not, why not, naming the setting
    deterministic: bool = False
    deterministic_off: str | None = None
    features: FeatureManifest | None = None  # the sparse autoencoders loaded (docs/sae.md), if any
    # bytes of keys and values the engine holds per token of a running request (the memory budget counts
    # them); 0 where the engine's KV memory is not per request (vLLM allocates its pool at start)
    kv_bytes_per_token: int = 0
    kv_block_tokens: int = 1  # the engine holds a request's keys and values in whole blocks of this many positions
    dtype: str = ""  # the weights' dtype as served ("bfloat16", "float32", ...), and why that one
    dtype_reason: str = ""
    packed_layers: int = 0  # linear layers whose weights the engine packed for its CPU kernels, and why (not)
    packed_reason: str = ""
    huge_page_bytes: int = 0  # bytes of loaded weights the engine moved into 2 MiB pages, and why (not)
    huge_pages_reason: str = ""
    mixed_passes: bool = False  # decoding streams' steps ride in prompt chunks' passes, and why (not)
    mixed_passes_reason: str = ""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation: the whole timeline for this turn, not just its delta.

    Engines reuse whatever they cached for the longest shared prefix (keyed by
    ``session_key`` as an affinity hint), so sending the whole list costs nothing extra.
    """

    request_id: str
    tokens: tuple[int, ...]
    spec: GenerateSpec
    images: tuple[ImageSpan, ...] = ()
    session_key: str | None = None
    fork: Fork | None = None  # one of several generations of this prompt: see Fork
    # the fair share's order among requests that begin together, lowest first: the slots its key held
    # beside it, per unit of weight, as it started (the pool sets it; 0 for a key with nothing else running)
    rank: float = 0.0


class Engine(Protocol):
    model_id: str  # known before start(): the name clients use for this model

    @property
    def info(self) -> EngineInfo:
        """What the engine serves; complete once start() has returned."""
        ...

    async def start(self) -> None:
        """Load the model; after this returns the engine serves requests."""

    def health(self) -> Health:
        """LOADING until start() returns, then READY; FAILED (with the reason) when loading
        failed or the engine can no longer serve; STOPPING once close() has begun."""
        ...

    async def close(self) -> None:
        """Stop work and free resources. In-flight generations end CANCELLED."""

    def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        """Stream TokenEvents then one Done. Closing the iterator cancels the request."""
        ...

    def image_tokens(self, data: bytes, mime: str) -> int:
        """How many image-pad tokens this image becomes under this model."""
        ...

    def release(self, session_key: str) -> None:
        """Forget cached state for a session that has gone away."""

    def in_flight(self) -> int:
        """Requests the engine is still working on (cancelled ones count until they are gone)."""
        ...


@runtime_checkable
class Holdable(Protocol):
    """An engine that can pause a request it is running: preemption's mechanism (the core decides whom).

    ``hold(request, True)`` stops ``request`` (the object given to ``generate``) at its next step
    boundary, its state (KV cache) kept; ``hold(request, False)`` lets it go on from there, producing
    exactly what it would have produced unpaused. With ``drop=True`` the engine frees the request's
    keys and values at that boundary instead, and recomputes them when let go, sending nothing twice:
    a deterministic request still produces exactly those bits. Returns whether the request is in
    flight here.
    """

    def hold(self, request: EngineRequest, held: bool, *, drop: bool = False) -> bool: ...
