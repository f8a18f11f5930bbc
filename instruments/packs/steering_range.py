"""Where and how hard a pack's concepts steer: per concept, a layer, a starting scale and a range.

A pack's directions read well at many layers but steer well at few, so the builder measures it
on the serving engine itself: short prompts answered greedily, steered by each concept at each
candidate layer up a ladder of scales; each answer read back by the unsteered model for its
**effect** (how far the concept's readout moved) and **fluency** (its mean logprob); the
starting rung is the most effective fluent one with :data:`MARGIN` fluent rungs above it.
Greedy and deterministic, so a rebuild measures the same numbers. The four steps in full:
docs/instruments.md, "Where a concept steers".
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import ChatMessage, Engine, EngineRequest
from prismgate.core.errors import invalid
from prismgate.core.events import TokenEvent
from prismgate.core.steering import SteeringEntry
from prismgate.engines.readouts.pack import ConceptPack, SteeringRange

PROMPTS: tuple[str, ...] = (
    "Tell me about your weekend.",
    "Write one sentence about a rainy Monday.",
)
TOKENS = 14  # greedy tokens per answer: enough to see a language or a mood turn, cheap to decode
SCALES: tuple[float, ...] = (8, 16, 32, 64)  # the ladder: each rung twice the one before
MAX_CANDIDATES = 3  # steering layers tried per concept
MAX_LOGPROB_DROP = 2.0  # nats per token the unsteered model may lose on a steered answer before it counts as broken
MIN_DISTINCT = 0.6  # an answer with a smaller share of distinct token trigrams repeats itself
MARGIN = 2  # fluent rungs a starting scale keeps above it at its layer
MAX_BATCH = 64  # decode steps of the measuring engine's requests that run as one forward pass

METHOD = (
    f"steering: per concept, greedy {TOKENS}-token answers to {len(PROMPTS)} chat prompts, steered at each candidate "
    f"layer (the shallower half of the pack's layers, at most {MAX_CANDIDATES}) with scales "
    f"{'/'.join(f'{s:g}' for s in SCALES)} (positions both) through the transformers engine; each answer read back "
    "unsteered: effect = the concept's readout over the answer minus the unsteered answer's, in scales, averaged over "
    f"the deeper half of the pack's layers; a rung is fluent while the answers' mean logprob stays on average within "
    f"{MAX_LOGPROB_DROP:g} nats of the unsteered answers' and each has at least {MIN_DISTINCT:g} of its token "
    f"trigrams distinct; layer and scale = the fluent rung of most effect among those with {MARGIN} fluent rungs "
    "above them at their layer, range = the last fluent rung at that layer"
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Answer:
    """One answer, read back by the unsteered model."""

    tokens: tuple[int, ...]
    logprob: float  # mean over the answer's tokens
    readout: float  # the concept's mean (value - center) / scale over the answer and the read layers
    distinct: float  # share of the answer's token trigrams that are distinct (:func:`distinct`)


def distinct(tokens: Sequence[int]) -> float:
    """Share of the token trigrams of ``tokens`` that are distinct: 1 for text that never repeats, low for a loop.

    Trigrams, not tokens, so that the measure does not fall with length for ordinary text (which
    reuses "the" and "a") yet catches "la la la" and "I'm a helpful AI? I'm a helpful AI?" alike.
    """
    grams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
    return len(set(grams)) / len(grams) if grams else 1.0


def fluent_rung(steered: Sequence[Answer], plain: Sequence[Answer]) -> bool:
    """The steered answers lose at most :data:`MAX_LOGPROB_DROP` on average, and none repeats itself."""
    drop = float(np.mean([p.logprob - s.logprob for s, p in zip(steered, plain, strict=True)]))
    return drop <= MAX_LOGPROB_DROP and all(s.distinct >= MIN_DISTINCT for s in steered)


@dataclass(frozen=True)
class Rung:
    concept: str
    layer: int
    scale: float
    effect: float  # mean over prompts of the readout moved, in scales
    fluent: bool
    answers: tuple[Answer, ...]


def candidate_layers(pack: ConceptPack) -> tuple[int, ...]:
    """The shallower half of the pack's layers (at most :data:`MAX_CANDIDATES`, evenly spread)."""
    shallow = pack.layers[: max(1, len(pack.layers) // 2)]
    if len(shallow) <= MAX_CANDIDATES:
        return shallow
    return tuple(sorted({shallow[round(i)] for i in np.linspace(0, len(shallow) - 1, MAX_CANDIDATES)}))


def read_layers(pack: ConceptPack) -> tuple[int, ...]:
    """Indices of the layers an answer is read at: the deeper half of the pack's."""
    n = len(pack.layers)
    return tuple(range(n // 2, n)) if n > 1 else (0,)


def measure_steering(
    folder: str | Path,
    pack: ConceptPack,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    threads: int = 1,
    progress: Progress | None = None,
) -> tuple[ConceptPack, list[Rung]]:
    """``pack`` with its measured :class:`SteeringRange` per concept, and every rung measured.

    Needs centers and scales (a pack built by this version has them). Starts a transformers
    engine on ``folder`` with the pack, so the model is loaded once more; slow: off the event loop.
    """
    if pack.centers is None or pack.scales is None:
        raise invalid("measuring steering needs a pack with centers and scales")
    return asyncio.run(_measure(Path(folder), pack, dtype, device, threads, progress or (lambda _t: None)))


async def _measure(
    folder: Path, pack: ConceptPack, dtype: str, device: str, threads: int, say: Progress
) -> tuple[ConceptPack, list[Rung]]:
    from prismgate.engines.hf.engine import TransformersEngine

    with tempfile.TemporaryDirectory(prefix="prismgate-steer-") as tmp:
        path = Path(tmp) / "pack.safetensors"
        pack.save(path)
        engine = TransformersEngine(
            folder, concept_pack=path, device=device, dtype=dtype, threads=threads, max_batch=MAX_BATCH
        )
        await engine.start()
        try:
            return await _ladders(engine, pack, say)
        finally:
            await engine.close()


async def _ladders(engine: Engine, pack: ConceptPack, say: Progress) -> tuple[ConceptPack, list[Rung]]:
    tokenizer = engine.info.tokenizer
    prompts = [tuple(tokenizer.render_chat([ChatMessage(role="user", content=p)])) for p in PROMPTS]
    runner = Runner(engine, pack)
    plain = await asyncio.gather(*(runner.answer(p, ()) for p in prompts))
    plain_read = {c: [runner.read(a, c) for a in plain] for c in pack.concepts}
    rungs: list[Rung] = []
    alive = [(c, layer) for c in pack.concepts for layer in candidate_layers(pack)]
    started = time.perf_counter()
    for scale in SCALES:
        if not alive:
            break
        say(f"steering: scale {scale:g}, {len(alive)} concept-layer pairs x {len(prompts)} prompts")
        results = await asyncio.gather(
            *(
                runner.answer(p, (SteeringEntry(layer=layer, scale=float(scale), concept=c),))
                for c, layer in alive
                for p in prompts
            )
        )
        survivors = []
        for k, (c, layer) in enumerate(alive):
            steered = results[k * len(prompts) : (k + 1) * len(prompts)]
            answers = tuple(runner.read(a, c) for a in steered)
            fluent = fluent_rung(answers, plain_read[c])
            effect = float(np.mean([a.readout - b.readout for a, b in zip(answers, plain_read[c], strict=True)]))
            rungs.append(Rung(c, layer, float(scale), effect, fluent, answers))
            if fluent:
                survivors.append((c, layer))
        alive = survivors
    say(f"steering measured in {time.perf_counter() - started:.1f} s")
    return replace(pack, steering=_choose(pack, rungs), method=pack.method + "; " + METHOD), rungs


def _choose(pack: ConceptPack, rungs: Sequence[Rung]) -> dict[str, SteeringRange]:
    """Per concept: the layer whose best fluent rung (with :data:`MARGIN` fluent rungs above it) moves the readout most.

    A concept with no fluent rung is left out.
    """
    chosen: dict[str, SteeringRange] = {}
    by_concept: dict[str, list[Rung]] = {}
    for rung in rungs:
        by_concept.setdefault(rung.concept, []).append(rung)
    for concept in pack.concepts:
        fluent = [r for r in by_concept.get(concept, []) if r.fluent]
        if not fluent:
            continue
        # a margin: answers longer than the measured ones drift further (a scale fluent for 14 tokens
        # can loop by the 40th), so start two rungs, a factor of 4, below the last fluent one
        margin = [r for r in fluent if sum(o.layer == r.layer and o.scale > r.scale for o in fluent) >= MARGIN]
        best = max(margin or fluent, key=lambda r: (r.effect, -r.scale, -r.layer))
        reach = max(r.scale for r in fluent if r.layer == best.layer)
        chosen[concept] = SteeringRange(layer=best.layer, scale=best.scale, range=reach, effect=round(best.effect, 2))
    return chosen


class Runner:
    """Requests through the engine: a greedy answer, and an answer read back unsteered."""

    def __init__(self, engine: Engine, pack: ConceptPack) -> None:
        self.engine = engine
        self.pack = pack
        self._reads = read_layers(pack)
        self._count = 0

    async def answer(self, prompt: tuple[int, ...], steering: tuple[SteeringEntry, ...]) -> Generated:
        """A greedy :data:`TOKENS`-token answer under ``steering``, with the unsteered model's reading of it."""
        spec = GenerateSpec(max_tokens=TOKENS, steering=steering, deterministic=True)
        tokens = [e.id async for e in self._run(prompt, spec) if isinstance(e, TokenEvent) and not e.is_prefill]
        whole = prompt + tuple(tokens)
        n = len(whole)
        covered = (PositionRange(len(prompt), n),)
        spec = GenerateSpec(max_tokens=0, logprob_ranges=covered, readout_ranges=covered, deterministic=True)
        events = [e for e in [e async for e in self._run(whole, spec)] if isinstance(e, TokenEvent)]
        return Generated(tuple(tokens), events)

    def read(self, read: Generated, concept: str) -> Answer:
        """What the unsteered reading says about ``concept`` and fluency."""
        assert self.pack.centers is not None and self.pack.scales is not None
        c = self.pack.concepts.index(concept)
        logprobs = [e.logprob for e in read.events if e.logprob is not None]
        values = []
        for e in read.events:
            if e.readout is None:
                continue
            for li in self._reads:
                values.append((float(e.readout[li][c]) - self.pack.centers[li, c]) / self.pack.scales[li, c])
        return Answer(
            tokens=read.tokens,
            logprob=float(np.mean(logprobs)) if logprobs else -math.inf,
            readout=float(np.mean(values)) if values else 0.0,
            distinct=distinct(read.tokens),
        )

    async def _run(self, tokens: tuple[int, ...], spec: GenerateSpec) -> AsyncIterator[object]:
        self._count += 1
        request = EngineRequest(request_id=f"steering-{self._count}", tokens=tokens, spec=spec)
        async for event in self.engine.generate(request):
            yield event


@dataclass(frozen=True)
class Generated:
    """An answer's tokens, and its unsteered reading: a TokenEvent per token with logprob and readouts."""

    tokens: tuple[int, ...]
    events: list[TokenEvent]


def describe_rungs(rungs: Sequence[Rung], decode: Callable[[Sequence[int]], str]) -> str:
    """Every rung measured, one line each (``prismgate concepts build --steering-report``)."""
    lines = []
    for r in rungs:
        texts = " | ".join(json.dumps(decode(a.tokens), ensure_ascii=False) for a in r.answers)
        lines.append(
            f"{r.concept:<12} L{r.layer:<3} {r.scale:>+5g}  effect {r.effect:+6.2f}  "
            f"{'fluent' if r.fluent else 'BROKEN'}  lp {'/'.join(f'{a.logprob:.2f}' for a in r.answers)}  "
            f"distinct {'/'.join(f'{a.distinct:.2f}' for a in r.answers)}  {texts}"
        )
    return "\n".join(lines)
