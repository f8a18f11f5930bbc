"""Reading a bearer key off the wire, the same way on every protocol.

Which key it is and what it may do is :mod:`prismgate.keys`' job (:meth:`KeyRing.authenticate`).
"""

from __future__ import annotations

from prismgate.core.errors import Code, GatewayError


def bearer_token(authorization: str | None) -> str:
    """The key in ``Bearer <key>``; UNAUTHENTICATED when there is none."""
    if not authorization:
        raise GatewayError(Code.UNAUTHENTICATED, "missing bearer token (send 'authorization: Bearer <token>')")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise GatewayError(Code.UNAUTHENTICATED, "invalid bearer token")
    return token.strip()
