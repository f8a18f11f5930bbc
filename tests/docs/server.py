"""``prismgate serve`` as a user starts it for the doc tests: stopped with SIGTERM, as a user stops it."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

from tests.serve_process import Served, serve_process

__all__ = ["Served", "serve"]


def serve(folder: Path, *args: str, timeout: float = 180) -> contextlib.AbstractContextManager[Served]:
    """Serve with ``args`` (plus free ports, one thread, JSON logs) until the block ends."""
    return serve_process(folder, *args, timeout=timeout, stop=signal.SIGTERM)
