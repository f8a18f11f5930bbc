"""salience.steering.v1.Steering: a session's standing steering for its later Generate calls.

salience.v1 is frozen and its GenerateRequest has no steering field, so steering reaches a
Salience session from the side: this service hands the entries to the core
(:meth:`~prismgate.core.service.SessionService.set_steering`), which keeps them on the
session and applies them to every later generation whose own spec names none. Entries are
counted against the budget before any is read, and read in a worker thread: a raw direction
may hold millions of numbers before the core can say it is not the model's hidden size. What
the entries mean the core checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import grpc

from prismgate.codecs.steering import entry_from_message
from prismgate.core.budget import RequestBudget
from prismgate.core.errors import invalid
from prismgate.core.service import SessionService
from prismgate.core.steering import Comparison, Gate, Positions, Steering, SteeringEntry
from prismgate.schemas import salience_steering_pb2 as pb
from prismgate.schemas import salience_steering_pb2_grpc as pb_grpc

POSITIONS: dict[int, Positions] = {
    pb.POSITIONS_UNSPECIFIED: Positions.BOTH,
    pb.POSITIONS_PROMPT: Positions.PROMPT,
    pb.POSITIONS_GENERATED: Positions.GENERATED,
    pb.POSITIONS_BOTH: Positions.BOTH,
}
COMPARISONS: dict[int, Comparison] = {pb.COMPARISON_ABOVE: Comparison.ABOVE, pb.COMPARISON_BELOW: Comparison.BELOW}
WIRE_COMPARISONS: dict[Comparison, pb.Comparison] = {
    Comparison.ABOVE: pb.COMPARISON_ABOVE,
    Comparison.BELOW: pb.COMPARISON_BELOW,
}
WIRE_POSITIONS: dict[Positions, pb.Positions] = {
    Positions.PROMPT: pb.POSITIONS_PROMPT,
    Positions.GENERATED: pb.POSITIONS_GENERATED,
    Positions.BOTH: pb.POSITIONS_BOTH,
}


class SteeringServicer(pb_grpc.SteeringServicer):
    def __init__(self, service: SessionService) -> None:
        self.service = service

    async def SetSteering(
        self, request: pb.SetSteeringRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetSteeringResponse:
        budget = self.service.budget
        budget.check_lists(steering_entries=len(request.entries))
        steering = await asyncio.to_thread(_steering, request.entries, budget)
        return pb.SetSteeringResponse(entries=_wire(await self.service.set_steering(request.session_id, steering)))

    async def GetSteering(
        self, request: pb.GetSteeringRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSteeringResponse:
        return pb.GetSteeringResponse(entries=_wire(await self.service.get_steering(request.session_id)))


def _steering(entries: Sequence[pb.SteeringEntry], budget: RequestBudget) -> Steering:
    return tuple(_entry(e, f"entries[{i}]", budget) for i, e in enumerate(entries))


def _entry(entry: pb.SteeringEntry, where: str, budget: RequestBudget) -> SteeringEntry:
    positions = POSITIONS.get(entry.positions)
    if positions is None:
        raise invalid(f"{where}.positions: unknown value {entry.positions}")
    comparison = None
    if entry.HasField("gate"):
        comparison = COMPARISONS.get(entry.gate.comparison)
        if comparison is None:
            raise invalid(f"{where}.gate.comparison must be COMPARISON_ABOVE or COMPARISON_BELOW")
    return entry_from_message(entry, positions, comparison, where, budget)


def _wire(steering: Steering) -> Iterable[pb.SteeringEntry]:
    return [
        pb.SteeringEntry(
            concept=e.concept or "",
            direction=e.direction or (),
            layer=e.layer,
            scale=e.scale,
            norm_match=e.norm_match,
            positions=WIRE_POSITIONS[e.positions],
            gate=_wire_gate(e.gate) if e.gate is not None else None,
            feature=e.feature,
            clamp=e.clamp,
        )
        for e in steering
    ]


def _wire_gate(gate: Gate) -> pb.Gate:
    return pb.Gate(
        concept=gate.concept or "",
        layer=gate.layer,
        comparison=WIRE_COMPARISONS[gate.comparison],
        threshold=gate.threshold,
        feature=gate.feature,
    )
