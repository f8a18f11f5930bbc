"""The optional shared bearer token, checked the same way on every protocol."""

from __future__ import annotations

import hmac

from prismgate.core.errors import Code, GatewayError


def check_bearer(expected: str | None, authorization: str | None) -> None:
    """Raise UNAUTHENTICATED unless ``authorization`` is ``Bearer <expected>``.

    With no token configured every caller is accepted. The comparison is constant-time.
    """
    if expected is None:
        return
    if not authorization:
        raise GatewayError(Code.UNAUTHENTICATED, "missing bearer token (send 'authorization: Bearer <token>')")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise GatewayError(Code.UNAUTHENTICATED, "invalid bearer token")
