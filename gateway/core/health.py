"""Where an engine, or the whole pool, is in its life: loading, ready, failed or stopping.

Readiness probes (``/readyz``, gRPC health) and the codecs' "model still loading" answers
read one value instead of a flag each caller sets by hand, so a replica whose model failed
to load, or that is draining, cannot be reported ready by mistake.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class HealthState(enum.Enum):
    LOADING = "loading"  # start() has not returned yet: nothing can be served
    READY = "ready"
    FAILED = "failed"  # the model could not load, or the engine broke down; it will not recover
    STOPPING = "stopping"  # shutting down: in-flight work may finish, new work goes elsewhere


@dataclass(frozen=True, slots=True)
class Health:
    state: HealthState
    reason: str = ""  # for people: why the state is not READY

    @property
    def ready(self) -> bool:
        return self.state is HealthState.READY


READY = Health(HealthState.READY)
LOADING = Health(HealthState.LOADING, "model loading")
STOPPING = Health(HealthState.STOPPING, "shutting down")


def failed(reason: str) -> Health:
    return Health(HealthState.FAILED, reason)


def worst(healths: list[Health]) -> Health:
    """The pool's health from its engines': stopping, then failed, then loading win over ready."""
    for state in (HealthState.STOPPING, HealthState.FAILED, HealthState.LOADING):
        for health in healths:
            if health.state is state:
                return health
    return READY
