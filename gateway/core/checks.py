"""Whether an action fits its session and its model: checked before anything changes.

The rules every :class:`~prismgate.core.actions.GenerateAction` meets, whatever protocol
sent it: the client's view of the session (offset, truncation), token ids inside the
vocabulary, image blocks that are what they claim to be, readouts only where a concept
pack is loaded, reported positions inside the turn. A failure here leaves the session
untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput
from prismgate.core.engine import EngineInfo
from prismgate.core.errors import invalid, precondition, quote
from prismgate.core.features import check_features, steered_feature
from prismgate.core.models import Models, no_concept_pack
from prismgate.core.session import ImageSpan, Session
from prismgate.core.steering import Steering, SteeringEntry


def check_offset(session: Session, action: GenerateAction) -> None:
    """The client's view of the session length agrees with the session (or rewinds to a boundary)."""
    if action.offset is None:
        if action.truncating:
            raise invalid("truncating needs an offset to rewind to")
        return
    length = len(session)
    if action.offset == length:
        return
    if action.offset < length and action.truncating:
        session.check_boundary(action.offset, "truncation")
        return
    if action.offset < length:
        raise precondition(
            f"offset {action.offset} is behind the session length {length}; "
            "set truncating to rewind, or resynchronise with DumpSession"
        )
    raise precondition(f"offset {action.offset} is past the session length {length}")


def check_vocabulary(info: EngineInfo, tokens: Sequence[int]) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < info.vocab_size:
            raise invalid(f"token id {t} at append index {i} is outside the vocabulary [0, {info.vocab_size})")


def check_sampling(info: EngineInfo, spec: GenerateSpec) -> None:
    """Token ids the sampler reads (stop ids, biased ids) in the vocabulary; ``min_tokens`` within ``max_tokens``."""
    if spec.min_tokens > spec.max_tokens:
        raise invalid(f"min_tokens ({spec.min_tokens}) must be <= max_tokens ({spec.max_tokens})")
    for what, ids in (("stop token id", spec.stop_token_ids), ("logit_bias token id", [t for t, _ in spec.logit_bias])):
        for t in ids:
            if not 0 <= t < info.vocab_size:
                raise invalid(f"{what} {t} is outside the vocabulary [0, {info.vocab_size})")


def check_readouts(info: EngineInfo, spec: GenerateSpec) -> None:
    """Readouts need a concept pack; features an SAE at every layer they name."""
    if spec.wants_readouts and info.readouts is None:
        raise no_concept_pack(info.model_id)
    if spec.features is not None:
        check_features(info.features, info.model_id, spec.features)


def resolve_deterministic(info: EngineInfo, spec: GenerateSpec, default: bool) -> GenerateSpec:
    """The spec with ``deterministic`` decided (the server's default where the request left it open), checked.

    A deterministic request needs an engine that can keep the promise (a refusal names why it
    cannot, never a silent best effort), and a seed when it samples: the same seed is what makes
    a sampled answer the same answer.
    """
    asked = spec.deterministic is not None
    deterministic = spec.deterministic if spec.deterministic is not None else default
    if deterministic:
        if not info.deterministic:
            name = info.engine_name or "this"
            why = info.deterministic_off or f"the {name} engine cannot run batch-invariant"
            raise precondition(f"deterministic requests are refused here: {why}")
        if spec.temperature > 0 and spec.top_k != 1 and spec.seed is None:
            source = "deterministic: true" if asked else "deterministic (the server's --deterministic default)"
            raise invalid(
                f"{source} at temperature > 0 needs a seed: send a seed, or temperature 0, or deterministic: false"
            )
    return spec if spec.deterministic is deterministic else replace(spec, deterministic=deterministic)


def check_steering(info: EngineInfo, steering: Steering) -> None:
    """Steering needs an engine that applies it, and the concept pack or SAEs whose layers, concepts
    and features it names: a concept at a pack layer, a feature at an SAE layer, a raw direction at
    either (an SAE layer only on an engine that steers by feature)."""
    if not steering:
        return
    name = info.engine_name or "this"
    if not info.steering:
        if info.steering_off is not None:
            raise invalid(f"steering is turned off on the {name} engine of this server ({info.steering_off})")
        raise invalid(f"steering is not supported by the {name} engine yet")
    manifest = info.readouts
    pack_layers = manifest.layers if manifest is not None else ()
    sae_layers = info.features.layers if info.features is not None and info.steering_features else ()
    for i, entry in enumerate(steering):
        where = f"steering entry {i}"
        if entry.feature is not None or (entry.gate is not None and entry.gate.feature is not None):
            if not info.steering_features:
                raise invalid(
                    f"{where}: steering by SAE feature (feature, clamp, a gate on a feature) is not supported "
                    f"by the {name} engine; steer by concept or direction"
                )
            if info.features is None:
                raise invalid(f"{where}: model {info.model_id!r} has no sparse autoencoder loaded (docs/sae.md)")
        if entry.feature is not None:
            steered_feature(info.features, entry.layer, entry.feature, where)
        else:
            _check_vector(info, entry, where, pack_layers, sae_layers)
        gate = entry.gate
        if gate is None:
            continue
        if not info.steering_gates:
            raise invalid(
                f"{where}: readout-gated steering is not supported by the {name} engine; steer without a gate"
            )
        if gate.feature is not None:
            steered_feature(info.features, gate.layer, gate.feature, f"{where}: gate")
            continue
        if manifest is None:
            raise no_concept_pack(info.model_id)
        if gate.layer not in manifest.layers:
            raise invalid(
                f"{where}: gate layer {gate.layer} is not a layer of the concept pack; gate on one of "
                f"{', '.join(str(layer) for layer in manifest.layers if layer <= entry.layer)}"
            )
        if gate.concept not in manifest.concepts:
            concepts = ", ".join(manifest.concepts)
            raise invalid(f"{where}: unknown gate concept {quote(gate.concept or '')}; the pack has {concepts}")


def _check_vector(
    info: EngineInfo, entry: SteeringEntry, where: str, pack_layers: tuple[int, ...], sae_layers: tuple[int, ...]
) -> None:
    """A concept entry against the pack; a raw direction against the layers the engine steers at."""
    manifest = info.readouts
    if entry.concept is not None or not sae_layers:
        if manifest is None:
            raise no_concept_pack(info.model_id)
        if entry.layer not in manifest.layers:
            raise invalid(
                f"{where}: layer {entry.layer} is not a layer of the concept pack; steer at one of "
                f"{', '.join(map(str, manifest.layers))}"
            )
        if entry.concept is not None and entry.concept not in manifest.concepts:
            raise invalid(
                f"{where}: unknown concept {quote(entry.concept)}; the pack has {', '.join(manifest.concepts)}"
            )
    elif entry.layer not in pack_layers and entry.layer not in sae_layers:
        layers = sorted({*pack_layers, *sae_layers})
        raise invalid(
            f"{where}: layer {entry.layer} has neither a concept pack layer nor an SAE; steer a direction at one of "
            f"{', '.join(map(str, layers))}"
        )
    hidden = manifest.hidden_size if manifest is not None else info.features.hidden_size if info.features else 0
    if entry.direction is not None and len(entry.direction) != hidden:
        raise invalid(f"{where}: a direction of {len(entry.direction)} numbers; the model's hidden size is {hidden}")


def check_ranges(prompt_tokens: int, spec: GenerateSpec) -> None:
    """Reported positions lie inside this turn's horizon (the prompt and the decode budget)."""
    horizon = prompt_tokens + spec.max_tokens
    features = spec.features.ranges if spec.features is not None else ()
    for name, ranges in (("logprob", spec.logprob_ranges), ("readout", spec.readout_ranges), ("feature", features)):
        for r in ranges:
            if r.end > horizon:
                raise invalid(
                    f"{name} range [{r.start}, {r.end}) reaches past position {horizon} "
                    f"(prompt {prompt_tokens} + max_tokens {spec.max_tokens})"
                )


async def check_images(
    models: Models, info: EngineInfo, base: int, tokens: list[int], images: Sequence[ImageInput]
) -> list[ImageSpan]:
    """Each declared image is a well-formed vision block of the size this model makes of it."""
    vision = info.vision
    if vision is None:
        if images:
            raise invalid(f"model {info.model_id!r} takes no images (it has no vision encoder)")
        return []
    spans: list[ImageSpan] = []
    for i, image in enumerate(sorted(images, key=lambda im: im.start)):
        where = f"image {i} at [{image.start}, {image.end})"
        if image.start < base or image.end > len(tokens) or image.end - image.start < 3:
            raise invalid(
                f"{where} must lie inside this call's appended tokens [{base}, {len(tokens)}) "
                "and hold at least start, one pad and end"
            )
        if spans and image.start < spans[-1].end:
            raise invalid(f"{where} overlaps the image at [{spans[-1].start}, {spans[-1].end})")
        run = tokens[image.start : image.end]
        if (
            run[0] != vision.vision_start
            or run[-1] != vision.vision_end
            or any(t != vision.image_pad for t in run[1:-1])
        ):
            raise invalid(f"{where} is not a <|vision_start|> + N*<|image_pad|> + <|vision_end|> run")
        # decoding and resizing an image takes a while: keep it off the event loop
        expected, _ = await asyncio.to_thread(models.image_tokens, image.data, image.mime, info.model_id)
        if expected != len(run) - 2:
            raise invalid(
                f"{where} holds {len(run) - 2} image pad tokens but this image becomes "
                f"{expected} under {info.model_id!r}; expected a range of length {expected + 2}"
            )
        spans.append(ImageSpan.of(image.start, image.end, image.data, image.mime))
    declared = {p for s in spans for p in range(s.start, s.end)}
    for position in range(base, len(tokens)):
        if tokens[position] == vision.image_pad and position not in declared:
            raise invalid(f"image pad token at position {position} belongs to no declared image")
    return spans
