"""Who is asking: the key a request authenticated with, and what that key may do.

The edge authenticates (a bearer header, gRPC metadata, a WebSocket subprotocol) and yields a
:class:`Principal`; the codec runs its core calls inside :func:`acting_as`, and the core decides
with it: the models a key may use, whether it may steer or read readouts and logprobs, which
sessions are its own, its limits and its share of a saturated pool. A context variable rather
than one more argument on every method: a principal belongs to the whole request, like its
request id in the logs, and :meth:`SessionService.generate` and friends read it once and carry
it from there. Without keys every caller is :data:`ANYONE`, who may do everything.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from prismgate.core.actions import GenerateSpec
from prismgate.core.errors import denied


@dataclass(frozen=True, slots=True)
class Principal:
    """A named key and its permissions. ``0`` for a limit means none."""

    name: str
    models: frozenset[str] | None = None  # the served model names it may use; None: every model
    steer: bool = True
    readouts: bool = True
    logprobs: bool = True
    playground: bool = True
    admin: bool = False  # may list and close every key's sessions
    max_concurrent: int = 0  # generations at once (across replicas when the store is Redis)
    tokens_per_minute: int = 0  # prompt plus generated tokens per minute
    weight: float = 1.0  # its share of a saturated pool, relative to the other keys'

    def owns(self, owner: str) -> bool:
        """Whether a session opened by ``owner`` is this key's to use (an admin's: every session)."""
        return self.admin or owner == self.name

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise denied(f"key {self.name!r} may not use model {model!r}")

    def check_steer(self) -> None:
        if not self.steer:
            raise denied(f"key {self.name!r} may not steer")

    def check_spec(self, spec: GenerateSpec) -> None:
        """PERMISSION_DENIED for what the spec asks that the key may not have."""
        if spec.steering:
            self.check_steer()
        if (spec.wants_readouts or spec.wants_features) and not self.readouts:
            raise denied(f"key {self.name!r} may not read readouts")
        if spec.wants_logprobs and not self.logprobs:
            raise denied(f"key {self.name!r} may not read logprobs")

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise denied(f"key {self.name!r} may not {what} (it needs the admin scope)")


ANYONE = Principal(name="", admin=True)  # no keys configured: every caller is the one user

_CURRENT: contextvars.ContextVar[Principal] = contextvars.ContextVar("prismgate_principal", default=ANYONE)


def current() -> Principal:
    """The principal of the request being handled (``ANYONE`` outside an authenticated request)."""
    return _CURRENT.get()


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[Principal]:
    """Run the block (and the tasks it spawns) as ``principal``."""
    token = _CURRENT.set(principal)
    try:
        yield principal
    finally:
        _CURRENT.reset(token)
