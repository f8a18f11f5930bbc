"""A ``prismgate serve`` over the null engine, in a process of its own, with 1 or N front-ends.

    .venv/bin/python -m bench.null_server --workers 2 --port-file ports.json

bench/overhead.py's ``--processes`` starts it so that the gateway's CPU is that of its own
processes (the supervisor, the engine host and the front-ends), apart from the clients'.
With ``--workers 1`` it is one process, the gateway as ``prismgate serve`` runs it; with N
it is :func:`prismgate.workers.supervisor.serve_workers` with the null engine built in the
engine host. Readouts: an 8 x 8 manifest of random float32s (bench/overhead.py's).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import settings
from bench.null_engine import NullEngine

READOUT_SHAPE = (8, 8)  # the default pack's layers x concepts


def null_engines(_settings: Any) -> list[Any]:
    """The engine host's engines: one null engine (module level: it crosses to the host by name)."""
    return [NullEngine(readouts=READOUT_SHAPE, readout_values="random")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args(argv)
    # 256 streams are 256 connections from one address: past the default cap of 128
    config = settings(
        model_name="null", max_connections_per_client=0, port_file=args.port_file, workers=args.workers, max_active=512
    )
    from prismgate import logs

    logs.configure(config)
    if args.workers > 1:
        from prismgate.workers.supervisor import serve_workers

        return serve_workers(config, engines=null_engines)
    from prismgate.compose import build_service
    from prismgate.server import Gateway

    gateway = Gateway(config, build_service(config, engine=null_engines(config)[0]))
    asyncio.run(gateway.run_until_signal())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
