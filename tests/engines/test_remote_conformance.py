"""The engine conformance suite against the transformers engine behind the engine host's IPC.

A ``--workers`` front-end reaches the engine through :class:`prismgate.workers.remote.RemoteEngine`;
this runs every conformance test through it (tests/engines/hosted.py), so what holds for an
engine in the process holds across the socket: events, errors, EOS, cancellation, release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.engines.hosted import HostedEngine
from tests.engines.test_conformance import *  # noqa: F403 (the same tests, collected here again)

# the transformers engine behind the host: not one of the suites the vLLM stage runs
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="session")
def engine_factory() -> Callable[..., Any]:
    return lambda model_dir, pack=None, **kw: HostedEngine(model_dir, pack, **kw)
