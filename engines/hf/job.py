"""One request as the worker thread sees it: its timeline, its KV cache and how far it has got."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from prismgate.core.engine import EngineRequest
from prismgate.core.events import Event, FinishReason, TokenEvent
from prismgate.engines.hf.bridge import EventChannel
from prismgate.engines.hf.grammar import Constraint
from prismgate.engines.hf.sampling import History
from prismgate.engines.hf.steering import GateKey, RowPlan, Vector


@dataclass(eq=False)
class Job:
    request: EngineRequest
    channel: EventChannel
    order: int = 0  # submission order: ties in priority go first come, first served
    # model state, owned by the worker thread
    started: bool = False
    cache: Any = None
    cached: list[int] = field(default_factory=list)  # token ids whose keys/values are in `cache`
    timeline: list[int] = field(default_factory=list)  # prompt, then generated tokens
    reused: int = 0  # prompt tokens served from the session's cache
    next_prefill: int = 0
    next_logits: torch.Tensor | None = None  # predicts position len(cached)
    held: TokenEvent | None = None  # a decoded token waiting for its readout
    generated: int = 0
    finish: FinishReason | None = None  # decided; Done goes out once the last readout is in
    generator: torch.Generator | None = None
    history: History | None = None  # what penalties and min_tokens read, when the request uses them
    constraint: Constraint | None = None  # the structured-output grammar's matcher, when the request has one
    steering: tuple[Vector, ...] = ()  # the request's steering, resolved on the device
    gates: dict[GateKey, list[float]] = field(default_factory=dict)  # its gate readouts, one per cached position
    invariant: bool = True  # every key and value in `cache` was computed by the batch-invariant kernels
    ended: bool = False  # Done or an error went out: the scheduler drops the job
    on_hold: bool = False  # preempted: skipped at every step boundary until let go, its cache kept ...
    drop: bool = False  # ... or dropped at the next step boundary (the core needs its bytes)
    refill: int = 0  # positions of `timeline` whose dropped keys and values are recomputed before it goes on

    @property
    def cancelled(self) -> bool:
        return self.channel.closed

    @property
    def idle(self) -> bool:
        """Not to be stepped now: its consumer is behind, or the core holds it (preempted)."""
        return self.on_hold or self.channel.paused

    @property
    def deterministic(self) -> bool:
        return bool(self.request.spec.deterministic)

    @property
    def prompt_len(self) -> int:
        return len(self.request.tokens)

    @property
    def refilling(self) -> bool:
        """Dropped keys and values are still to be recomputed (:meth:`Stepper.drop`)."""
        return len(self.cached) < self.refill

    @property
    def prefilling(self) -> bool:
        """Prompt tokens are still to run, or dropped ones to run again (or the request has not begun:
        what its session keeps is not known yet)."""
        return not self.ended and (not self.started or self.next_prefill < self.prompt_len or self.refilling)

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to run, with those to run again."""
        return max(0, self.refill - len(self.cached)) + self.prompt_len - self.next_prefill

    @property
    def prompt_outputs(self) -> bool:
        """Some prompt position is scored, read out or encoded: its prefill costs more per token."""
        spec = self.request.spec
        ranges = spec.logprob_ranges + spec.readout_ranges + (spec.features.ranges if spec.features else ())
        return any(r.start < self.prompt_len and r.end > r.start for r in ranges)

    @property
    def decoding(self) -> bool:
        """The next step feeds the last sampled token: a plain decode step, batchable."""
        return (
            self.started
            and not self.ended
            and self.finish is None
            and self.next_prefill >= self.prompt_len
            and len(self.timeline) > self.prompt_len
            and not self.refilling
        )

    def steer(self, row: int, start: int, end: int) -> RowPlan:
        """What this job's steering adds when positions ``[start, end)`` run as row ``row``."""
        before = {key: values[start - 1] for key, values in self.gates.items() if start > 0}
        return RowPlan(row, start, end - start, self.prompt_len, self.steering, before)

    def record_gates(self, values: Mapping[GateKey, torch.Tensor], row: int, tokens: int) -> None:
        """Keep the gate readouts of the ``tokens`` positions this job ran as row ``row``."""
        for key, kept in self.gates.items():
            kept.extend(values[key][row, :tokens].tolist())

    def emit(self, item: Event | BaseException) -> None:
        self.channel.send(item)
